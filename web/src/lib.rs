//! expertkv in the browser: the same pipeline on WebGPU through wasm32. This crate is the entry
//! point of the web build; the page, the viewer beside the pipeline and the browser test come
//! with the web issue. On native targets it compiles to nothing but its tests.

#[cfg(target_arch = "wasm32")]
mod wasm {
    use wasm_bindgen::prelude::*;

    /// Called by the page: reports what the browser offers.
    #[wasm_bindgen]
    pub fn expertkv_version() -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }

    #[wasm_bindgen(start)]
    pub fn start() {
        web_sys::console::log_1(&format!("expertkv-web {}", env!("CARGO_PKG_VERSION")).into());
    }
}

/// The version string the page shows.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[cfg(test)]
mod tests {
    #[test]
    fn version_is_the_workspace_version() {
        assert_eq!(super::version(), "0.1.0");
    }
}
