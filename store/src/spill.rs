//! The host tier's spill tier on a [`PageStore`]: the K/V words of FlexGen's coldest host pages
//! ([`expertkv_core::evict::flexgen::SpillTier`]), one key per page under
//! `{namespace}:spill:{run}:{id}`, each value with a magic, the format version, the run, the id,
//! the word count and a checksum; a value that fails a check is a lost page, never data.

use expertkv_core::evict::flexgen::SpillTier;

use crate::PageStore;
use crate::value::{FORMAT_VERSION, seal, unseal};

const MAGIC: &[u8; 4] = b"EKVS";

/// Spilled pages expire after a day: a run that ends normally removes its own
/// (`FlexGen::release_spilled`); one that dies leaves them to the server.
pub const SPILL_TTL_S: u64 = 24 * 3600;

/// FlexGen's spill tier in a page store, for one run (its keys apart from every other run's).
pub struct StoreSpill {
    store: Box<dyn PageStore>,
    prefix: String,
    run: u64,
}

impl StoreSpill {
    /// Spill into `store` under `{namespace}:spill:{run}:`; `run` tells this process's pages
    /// from another's (a process id and a clock, say).
    pub fn new(store: Box<dyn PageStore>, namespace: &str, run: u64) -> crate::Result<Self> {
        crate::check_namespace(namespace)?;
        Ok(StoreSpill { store, prefix: format!("{namespace}:spill:{run:016x}:"), run })
    }

    fn key(&self, id: u64) -> String {
        format!("{}{id}", self.prefix)
    }

    fn encode(&self, id: u64, words: &[u32]) -> Vec<u8> {
        let mut b = Vec::with_capacity(32 + 4 * words.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&self.run.to_le_bytes());
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&(words.len() as u32).to_le_bytes());
        for w in words {
            b.extend_from_slice(&w.to_le_bytes());
        }
        seal(b)
    }

    fn decode(&self, id: u64, b: &[u8]) -> Option<Vec<u32>> {
        let head = 4 + 2 + 8 + 8 + 4;
        let body = unseal(b).filter(|body| body.len() >= head && &body[..4] == MAGIC)?;
        let le64 = |s: &[u8]| s.try_into().ok().map(u64::from_le_bytes);
        let version = u16::from_le_bytes([body[4], body[5]]);
        let n = u32::from_le_bytes(body[22..26].try_into().ok()?) as usize;
        if version != FORMAT_VERSION || le64(&body[6..14])? != self.run || le64(&body[14..22])? != id || body.len() != head + 4 * n {
            return None;
        }
        Some(body[head..].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

impl SpillTier for StoreSpill {
    fn name(&self) -> String {
        format!("the KV page store at {}", self.store.addr())
    }

    fn put_many(&mut self, pages: &[(u64, &[u32])]) -> Result<(), String> {
        let items: Vec<(String, Vec<u8>)> = pages.iter().map(|&(id, w)| (self.key(id), self.encode(id, w))).collect();
        // A run that dies leaves its pages to expire.
        self.store.put_many(&items, Some(SPILL_TTL_S)).map_err(|e| e.to_string())
    }

    fn take(&mut self, id: u64) -> Result<Option<Vec<u32>>, String> {
        let key = self.key(id);
        let v = self.store.get_many(std::slice::from_ref(&key)).map_err(|e| e.to_string())?;
        let words = v.into_iter().next().flatten().and_then(|b| self.decode(id, &b));
        // Best effort: a key left behind expires (SPILL_TTL_S).
        let _ = self.store.remove_many(&[key]);
        Ok(words)
    }

    fn discard(&mut self, ids: &[u64]) {
        let keys: Vec<String> = ids.iter().map(|&id| self.key(id)).collect();
        let _ = self.store.remove_many(&keys);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// Pages come back as they went, once; a damaged value, another run's value and a value
    /// stored under another id are lost pages (`None`), not data.
    #[test]
    fn spilled_pages_come_back_once_and_damaged_ones_are_lost() {
        let mut s = StoreSpill::new(Box::new(MemoryStore::new()), "t", 7).expect("spill");
        let a: Vec<u32> = (0..64u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let b: Vec<u32> = (0..64).map(|i| i ^ 0xdead_beef).collect();
        s.put_many(&[(1, &a), (2, &b)]).expect("put");
        assert_eq!(s.take(1).expect("take"), Some(a.clone()));
        assert_eq!(s.take(1).expect("take"), None, "taken twice");
        let mut v = s.encode(2, &b);
        v[30] ^= 1;
        assert_eq!(s.decode(2, &v), None, "a flipped byte");
        assert_eq!(s.decode(3, &s.encode(2, &b)), None, "another id's value");
        let other = StoreSpill::new(Box::new(MemoryStore::new()), "t", 8).expect("spill");
        assert!(StoreSpill::new(Box::new(MemoryStore::new()), "a*", 8).is_err());
        assert_eq!(s.decode(2, &other.encode(2, &b)), None, "another run's value");
        assert_eq!(s.take(2).expect("take"), Some(b));
    }
}
