//! `tokenspeed._core`: the Python face of the Rust core — `serve(config)` for the server
//! process, the in-process `Engine` of the offline API, and the worker side of the shared-memory plan channel.

use pyo3::prelude::*;

mod channel;
mod engine;
mod server;
mod writer;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    channel::register(m)?;
    engine::register(m)?;
    server::register(m)?;
    writer::register(m)?;
    Ok(())
}
