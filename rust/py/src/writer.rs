//! `tokenspeed._core.PlanWriter`: the writing end of a plan channel, driven from Python. The
//! multi-node relay writes node 0's plans into another node's ring with it (launch/relay.py),
//! and tests play the server with it over real shared memory. Plans go in and results come out
//! as arrays named by the schema, through the same derived codec as the server: no parser here.

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokenspeed_engine::schema::Message;
use tokenspeed_engine::{Plan, StepResult};
use tokenspeed_ipc::{codec, PlanChannel};

use crate::channel::{ms, to_py, try_lock, ChannelShutdown};

#[pyclass(module = "tokenspeed._core")]
pub struct PlanWriter {
    inner: Mutex<Option<PlanChannel>>,
}

fn with_writer<R>(w: &PlanWriter, f: impl FnOnce(&mut PlanChannel) -> PyResult<R>) -> PyResult<R> {
    match try_lock(&w.inner)?.as_mut() {
        Some(ch) => f(ch),
        None => Err(ChannelShutdown::new_err("plan writer closed")),
    }
}

#[pymethods]
impl PlanWriter {
    /// Creates a channel `name` for `n_readers` ranks and returns its writing end.
    #[staticmethod]
    #[pyo3(signature = (name, n_readers=1, slots=8, slot_bytes=1 << 20))]
    fn create(name: &str, n_readers: u32, slots: u32, slot_bytes: u32) -> PyResult<PlanWriter> {
        let ch = PlanChannel::create(name, slots, slot_bytes, n_readers).map_err(to_py)?;
        Ok(PlanWriter {
            inner: Mutex::new(Some(ch)),
        })
    }

    /// Sends a plan given as {schema array name: little-endian bytes} (GIL released while
    /// blocked); missing arrays are zeros / empty lists.
    #[pyo3(signature = (step_id, arrays, timeout_ms=Some(10_000)))]
    fn send_plan(
        &self,
        py: Python<'_>,
        step_id: u64,
        arrays: HashMap<String, Vec<u8>>,
        timeout_ms: Option<u64>,
    ) -> PyResult<()> {
        let mut buf = vec![0u8; with_writer(self, |ch| Ok(ch.slot_bytes()))?];
        let get = |name: &str| arrays.get(name).map(Vec::as_slice);
        let n = codec::encode_arrays::<Plan>(step_id, get, &mut buf).map_err(to_py)?;
        let plan = codec::decode::<Plan>(&buf[..n]).map_err(to_py)?;
        with_writer(self, |ch| {
            py.allow_threads(|| ch.send_plan(&plan, ms(timeout_ms)))
                .map_err(to_py)
        })
    }

    /// The next result as {schema array name: bytes} plus `step_id`, or None after
    /// `timeout_ms`.
    #[pyo3(signature = (timeout_ms=Some(10_000)))]
    fn recv_result<'py>(
        &self,
        py: Python<'py>,
        timeout_ms: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let r = with_writer(self, |ch| {
            py.allow_threads(|| ch.recv_result(ms(timeout_ms)))
                .map_err(to_py)
        })?;
        let Some(r) = r else { return Ok(None) };
        let mut buf = vec![0u8; r.encoded_len()];
        r.encode(&mut buf).map_err(|e| to_py(e.into()))?;
        let lay = StepResult::layout_of(&buf).map_err(|e| to_py(e.into()))?;
        let d = PyDict::new(py);
        d.set_item("step_id", r.step_id)?;
        for a in &lay.arrays {
            let bytes = &buf[a.offset..a.offset + a.count * a.dtype.size()];
            d.set_item(&a.name, pyo3::types::PyBytes::new(py, bytes))?;
        }
        Ok(Some(d))
    }

    /// Whether rank `rank` is attached and alive.
    fn reader_alive(&self, rank: u32) -> PyResult<bool> {
        with_writer(self, |ch| Ok(ch.reader_alive(rank)))
    }

    /// Shuts the channel down: workers' waits raise ChannelShutdown.
    fn shutdown(&self) -> PyResult<()> {
        with_writer(self, |ch| {
            ch.shutdown();
            Ok(())
        })
    }

    /// Shuts down and unlinks the segment (also done when the object is collected).
    fn close(&self, py: Python<'_>) {
        let ch = py.allow_threads(|| match self.inner.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        });
        drop(ch);
    }
}

/// Adds `PlanWriter` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PlanWriter>()
}
