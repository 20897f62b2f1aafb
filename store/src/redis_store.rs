//! [`PageStore`] on Redis or Valkey (RESP over TCP or a Unix socket) through the `redis` crate:
//! gets as MGET, puts as one pipeline of SETs, both in batches; stats and clear by SCAN.

use std::time::Duration;

use crate::{PageStore, Result, StoreError, StoreStats, check_namespace, key_model, namespace_prefix, redact};

/// Keys per MGET, SET pipeline or EXISTS pipeline (one round trip each).
pub const BATCH_KEYS: usize = 256;

/// A connection to a Redis or Valkey server.
pub struct RedisStore {
    con: redis::Connection,
    addr: String,
}

impl RedisStore {
    /// Connect to `url` (`redis://[:PASSWORD@]HOST:PORT[/DB]` or `redis+unix:///PATH`), with
    /// `timeout` for the connection and every request. TLS (`rediss://`) is not built in.
    pub fn connect(url: &str, timeout: Duration) -> Result<RedisStore> {
        let shown = redact(url);
        if url.starts_with("rediss://") || url.starts_with("valkeys://") {
            return Err(StoreError::Options(format!(
                "{shown}: TLS is not built into this expertkv; use redis:// on loopback, or a TLS tunnel"
            )));
        }
        if !["redis://", "valkey://", "redis+unix://", "unix://"].iter().any(|s| url.starts_with(s)) {
            return Err(StoreError::Options(format!(
                "`{shown}` is not a Redis URL: give redis://HOST:PORT/DB (redis://:PASSWORD@HOST:PORT/DB with AUTH)"
            )));
        }
        let client = redis::Client::open(url).map_err(|e| StoreError::Options(format!("`{shown}`: {e}")))?;
        let addr = format!("{}", client.get_connection_info().addr());
        let con =
            client.get_connection_with_timeout(timeout).map_err(|e| StoreError::Connect { addr: addr.clone(), message: e.to_string() })?;
        let set = |con: &redis::Connection| -> redis::RedisResult<()> {
            con.set_read_timeout(Some(timeout))?;
            con.set_write_timeout(Some(timeout))
        };
        set(&con).map_err(|e| StoreError::Connect { addr: addr.clone(), message: e.to_string() })?;
        let mut s = RedisStore { con, addr };
        // A wrong password or database shows here, not at the first page.
        let pong: String = redis::cmd("PING").query(&mut s.con).map_err(|e| s.err(e))?;
        if pong != "PONG" {
            return Err(StoreError::Connect { addr: s.addr.clone(), message: format!("PING answered `{pong}`") });
        }
        Ok(s)
    }

    fn check_len(&self, got: usize, asked: usize, what: &str) -> Result<()> {
        if got != asked {
            return Err(StoreError::Server {
                addr: self.addr.clone(),
                message: format!("{what}: {got} replies where {asked} were asked for"),
            });
        }
        Ok(())
    }

    fn err(&self, e: redis::RedisError) -> StoreError {
        StoreError::Server { addr: self.addr.clone(), message: e.to_string() }
    }

    /// Bound the server's memory (`CONFIG SET maxmemory`, evicting the least recently used keys
    /// past it: `maxmemory-policy allkeys-lru`). The setting is the whole server's, for every key
    /// on it. A key the server evicts is a miss.
    pub fn set_max_memory(&mut self, bytes: u64) -> Result<()> {
        redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(bytes).query::<()>(&mut self.con).map_err(|e| self.err(e))?;
        redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("allkeys-lru").query::<()>(&mut self.con).map_err(|e| self.err(e))
    }

    fn info_memory(&mut self) -> (Option<u64>, Option<u64>) {
        let Ok(info) = redis::cmd("INFO").arg("memory").query::<String>(&mut self.con) else { return (None, None) };
        let field = |name: &str| {
            info.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')).and_then(|v| v.trim().parse().ok()))
        };
        (field("used_memory"), field("maxmemory"))
    }

    fn scan(&mut self, namespace: &str) -> Result<Vec<String>> {
        check_namespace(namespace)?;
        let prefix = namespace_prefix(namespace);
        let pattern = format!("{prefix}*");
        let mut cursor: u64 = 0;
        let mut keys = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query(&mut self.con)
                .map_err(|e| self.err(e))?;
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.retain(|k| k.starts_with(&prefix));
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }
}

impl PageStore for RedisStore {
    fn addr(&self) -> String {
        self.addr.clone()
    }

    fn get_many(&mut self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        // MGETs of BATCH_KEYS keys, up to 16 of them in one pipeline (one round trip).
        let mut out = Vec::with_capacity(keys.len());
        for trip in keys.chunks(BATCH_KEYS * 16) {
            let mut p = redis::pipe();
            for part in trip.chunks(BATCH_KEYS) {
                p.cmd("MGET").arg(part);
            }
            let replies: Vec<Vec<Option<Vec<u8>>>> = p.query(&mut self.con).map_err(|e| self.err(e))?;
            self.check_len(replies.len(), trip.len().div_ceil(BATCH_KEYS), "pipelined MGET commands")?;
            for (v, part) in replies.into_iter().zip(trip.chunks(BATCH_KEYS)) {
                self.check_len(v.len(), part.len(), "MGET")?;
                out.extend(v);
            }
        }
        Ok(out)
    }

    fn exists_many(&mut self, keys: &[String]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(BATCH_KEYS) {
            let mut p = redis::pipe();
            for k in part {
                p.cmd("EXISTS").arg(k);
            }
            let v: Vec<u32> = p.query(&mut self.con).map_err(|e| self.err(e))?;
            self.check_len(v.len(), part.len(), "EXISTS")?;
            out.extend(v.into_iter().map(|x| x > 0));
        }
        Ok(out)
    }

    fn put_many(&mut self, items: &[(String, Vec<u8>)], ttl_s: Option<u64>) -> Result<()> {
        for part in items.chunks(BATCH_KEYS) {
            let mut p = redis::pipe();
            for (k, v) in part {
                let c = p.cmd("SET").arg(k).arg(v.as_slice());
                if let Some(t) = ttl_s {
                    c.arg("EX").arg(t);
                }
                c.ignore();
            }
            p.query::<()>(&mut self.con).map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    fn remove_many(&mut self, keys: &[String]) -> Result<u64> {
        let mut n = 0u64;
        for part in keys.chunks(BATCH_KEYS) {
            let d: u64 = redis::cmd("UNLINK").arg(part).query(&mut self.con).map_err(|e| self.err(e))?;
            n += d;
        }
        Ok(n)
    }

    fn stats(&mut self, namespace: &str) -> Result<StoreStats> {
        let keys = self.scan(namespace)?;
        let mut bytes = 0u64;
        for part in keys.chunks(BATCH_KEYS) {
            let mut p = redis::pipe();
            for k in part {
                p.cmd("STRLEN").arg(k);
            }
            let v: Vec<u64> = p.query(&mut self.con).map_err(|e| self.err(e))?;
            bytes += v.iter().sum::<u64>();
        }
        let mut models: Vec<&str> = keys.iter().filter_map(|k| key_model(k)).collect();
        models.sort_unstable();
        models.dedup();
        let (used, max) = self.info_memory();
        Ok(StoreStats {
            addr: self.addr(),
            keys: keys.len() as u64,
            value_bytes: bytes,
            models: models.len() as u64,
            server_used_bytes: used,
            server_max_bytes: max,
        })
    }

    fn clear(&mut self, namespace: &str) -> Result<u64> {
        let keys = self.scan(namespace)?;
        self.remove_many(&keys)
    }
}
