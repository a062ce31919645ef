//! Python classes for the worker side of the shm channel (`WorkerChannel`) and a test writer.
//!
//! `WorkerChannel.recv()` hands out numpy views of the slot (zero copy), built with
//! `numpy.frombuffer` over a read-only memoryview of the shared memory: the payload layout
//! stays private to Rust, and no numpy crate is needed. Views are valid until the next
//! `recv()` (which gives the slot back to the server). The mapping itself stays until the
//! process exits, so a stale view reads stale data but cannot crash.

use std::os::raw::{c_char, c_int};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use pyo3::exceptions::{
    PyConnectionError, PyOSError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use serde_json::Value;
use tokenspeed_engine::plan::{NewRequestPlan, PageTableUpdate, ScheduledRequest};
use tokenspeed_engine::{Plan, SamplingParams};
use tokenspeed_ipc::{
    codec, ChannelStatus, IpcError, PlanChannel, ResultBytes, WorkerChannel as Channel,
};

pyo3::create_exception!(
    _core,
    ChannelShutdown,
    PyConnectionError,
    "The server shut the plan channel down (or went away)."
);

/// `PyBUF_READ` from CPython's stable ABI (a read-only memoryview).
const PY_BUF_READ: c_int = 0x100;

fn to_py(e: IpcError) -> PyErr {
    match e {
        IpcError::Shutdown => ChannelShutdown::new_err(e.to_string()),
        IpcError::Timeout => PyTimeoutError::new_err(e.to_string()),
        IpcError::TooLarge { .. } | IpcError::BadResult(_) | IpcError::InvalidConfig(_) => {
            PyValueError::new_err(e.to_string())
        }
        IpcError::InvalidName(_) | IpcError::BadRank { .. } | IpcError::NotRankZero(_) => {
            PyValueError::new_err(e.to_string())
        }
        IpcError::Os { .. } | IpcError::NotFound(_) | IpcError::NotReady(_) => {
            PyOSError::new_err(e.to_string())
        }
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn ms(timeout_ms: Option<u64>) -> Option<Duration> {
    timeout_ms.map(Duration::from_millis)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Locks without blocking: blocking here while holding the GIL could deadlock with a thread
/// that waits (GIL released) while holding the lock. Concurrent use is a caller bug.
fn try_lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => {
            Err(PyRuntimeError::new_err("channel in use by another thread"))
        }
    }
}

/// One worker rank's end of the channel (rank 0 also sends results).
#[pyclass(module = "tokenspeed._core")]
pub struct WorkerChannel {
    // Its mapping is kept until the process exits (`keep_mapped_forever`): numpy views may
    // outlive this object and must keep pointing at mapped memory.
    inner: Mutex<Channel>,
    status: ChannelStatus,
    frombuffer: Py<PyAny>,
    rank: u32,
}

#[pymethods]
impl WorkerChannel {
    /// Attaches to the channel `name` as `rank`, waiting up to `timeout_ms` for the server
    /// to create it (0: fail at once if it is not there).
    #[staticmethod]
    #[pyo3(signature = (name, rank, timeout_ms=0))]
    fn attach(py: Python<'_>, name: &str, rank: u32, timeout_ms: u64) -> PyResult<WorkerChannel> {
        let frombuffer = py.import("numpy")?.getattr("frombuffer")?.unbind();
        let timeout = Duration::from_millis(timeout_ms);
        let inner = py
            .allow_threads(|| Channel::attach_wait(name, rank, timeout))
            .map_err(to_py)?;
        inner.keep_mapped_forever();
        let status = inner.status();
        Ok(WorkerChannel {
            inner: Mutex::new(inner),
            status,
            frombuffer,
            rank,
        })
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Gives the previous plan back, waits for the next one (GIL released) and returns it as
    /// a dict of numpy views (keys of `tokenspeed.plan.StepPlan`), or None after
    /// `timeout_ms` (None: wait until a plan or shutdown). Raises ChannelShutdown.
    /// The views are valid until the next `recv()`/`release()`.
    #[pyo3(signature = (timeout_ms=None))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout_ms: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut guard = try_lock(&self.inner)?;
        let ch: &mut Channel = &mut guard;
        let timeout = ms(timeout_ms);
        let got = py
            .allow_threads(|| ch.recv_raw(timeout).map(|p| p.is_some()))
            .map_err(to_py)?;
        if !got {
            return Ok(None);
        }
        let payload = ch.held().expect("a plan was just received");
        let lay = codec::plan_layout_of(payload).map_err(to_py)?;
        // SAFETY: the payload lies in our shared mapping, which stays mapped until the process
        // exits (`keep_mapped_forever` in `attach`); the memoryview is read-only, so Python
        // cannot write into the slot.
        let mv = unsafe {
            let ptr = pyo3::ffi::PyMemoryView_FromMemory(
                payload.as_ptr() as *mut c_char,
                payload.len() as pyo3::ffi::Py_ssize_t,
                PY_BUF_READ,
            );
            Bound::from_owned_ptr_or_err(py, ptr)?
        };
        let frombuffer = self.frombuffer.bind(py);
        let d = PyDict::new(py);
        d.set_item("step_id", lay.step_id)?;
        for a in lay.arrays.iter().filter(|a| a.worker_visible) {
            let kw = PyDict::new(py);
            kw.set_item("dtype", a.dtype.numpy())?;
            kw.set_item("count", a.count)?;
            kw.set_item("offset", a.offset)?;
            d.set_item(a.name, frombuffer.call((&mv,), Some(&kw))?)?;
        }
        Ok(Some(d))
    }

    /// Gives the current plan's slot back now (instead of at the next `recv`).
    fn release(&self) -> PyResult<()> {
        try_lock(&self.inner)?.release();
        Ok(())
    }

    /// Sends one step's results (rank 0 only): little-endian arrays as from numpy
    /// `.tobytes()`: slots u32[n], tokens u32[n], logprobs f32[n], top_ids u32[n*top_k],
    /// top_logprobs f32[n*top_k]. Blocks (GIL released) while the result ring is full;
    /// raises TimeoutError after `timeout_ms`, ChannelShutdown after shutdown.
    #[pyo3(signature = (step_id, slots, tokens, logprobs, top_ids, top_logprobs, top_k, timeout_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn send_results(
        &self,
        py: Python<'_>,
        step_id: u64,
        slots: &[u8],
        tokens: &[u8],
        logprobs: &[u8],
        top_ids: &[u8],
        top_logprobs: &[u8],
        top_k: u32,
        timeout_ms: Option<u64>,
    ) -> PyResult<()> {
        let r = ResultBytes {
            step_id,
            top_k,
            slots,
            tokens,
            logprobs,
            top_ids,
            top_logprobs,
        };
        let mut guard = try_lock(&self.inner)?;
        let ch: &mut Channel = &mut guard;
        py.allow_threads(|| ch.send_result_bytes(&r, ms(timeout_ms)))
            .map_err(to_py)
    }

    /// Whether the server process that created the channel is alive.
    fn server_alive(&self) -> bool {
        self.status.server_alive()
    }

    fn is_shutdown(&self) -> bool {
        self.status.is_shutdown()
    }
}

/// Test hook: the server's end without the server (Python tests round-trip real shm).
#[pyclass(module = "tokenspeed._core")]
pub struct TestWriter {
    inner: Mutex<Option<PlanChannel>>,
}

fn with_writer<R>(w: &TestWriter, f: impl FnOnce(&mut PlanChannel) -> PyResult<R>) -> PyResult<R> {
    match try_lock(&w.inner)?.as_mut() {
        Some(ch) => f(ch),
        None => Err(ChannelShutdown::new_err("test writer closed")),
    }
}

fn items<'a>(v: &'a Value, key: &str) -> PyResult<&'a [Value]> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(PyValueError::new_err(format!("{key}: expected a list"))),
    }
}

/// Integers (bools count as 0/1) of `key`, empty when missing; `dflt` fills in for `n` if given.
fn ints(v: &Value, key: &str, fill: Option<(usize, i64)>) -> PyResult<Vec<i64>> {
    let bad = || PyValueError::new_err(format!("{key}: expected integers"));
    let out: Vec<i64> = items(v, key)?
        .iter()
        .map(|x| {
            x.as_bool()
                .map(i64::from)
                .or_else(|| x.as_i64())
                .ok_or_else(bad)
        })
        .collect::<PyResult<_>>()?;
    Ok(match fill {
        Some((n, d)) if out.is_empty() => vec![d; n],
        _ => out,
    })
}

fn u32s(v: &Value, key: &str) -> PyResult<Vec<u32>> {
    let bad = || PyValueError::new_err(format!("{key}: value out of u32 range"));
    ints(v, key, None)?
        .into_iter()
        .map(|x| u32::try_from(x).map_err(|_| bad()))
        .collect()
}

fn floats(v: &Value, key: &str, n: usize, dflt: f32) -> PyResult<Vec<f32>> {
    let bad = || PyValueError::new_err(format!("{key}: expected numbers"));
    let out: Vec<f32> = items(v, key)?
        .iter()
        .map(|x| x.as_f64().map(|f| f as f32).ok_or_else(bad))
        .collect::<PyResult<_>>()?;
    Ok(if out.is_empty() { vec![dflt; n] } else { out })
}

/// A `Plan` from JSON with the keys of `StepPlan` (missing keys: empty / defaults);
/// `sample` may hold bools or 0/1, `cached_len` is optional.
fn plan_from_json(json: &str) -> PyResult<Plan> {
    let v: Value = serde_json::from_str(json).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let new_slots = u32s(&v, "new_slots")?;
    let n = new_slots.len();
    let d = SamplingParams::default();
    let temp = floats(&v, "new_temperature", n, d.temperature)?;
    let top_p = floats(&v, "new_top_p", n, d.top_p)?;
    let min_p = floats(&v, "new_min_p", n, d.min_p)?;
    let rep = floats(&v, "new_repetition_penalty", n, d.repetition_penalty)?;
    let freq = floats(&v, "new_frequency_penalty", n, d.frequency_penalty)?;
    let pres = floats(&v, "new_presence_penalty", n, d.presence_penalty)?;
    let top_k = ints(&v, "new_top_k", Some((n, -1)))?;
    let seed = ints(&v, "new_seed", Some((n, -1)))?;
    let top_lp = ints(&v, "new_top_logprobs", Some((n, 0)))?;
    let lens = [
        temp.len(),
        top_p.len(),
        min_p.len(),
        rep.len(),
        freq.len(),
        pres.len(),
    ];
    if lens
        .iter()
        .chain(&[top_k.len(), seed.len(), top_lp.len()])
        .any(|&l| l != n)
    {
        return Err(PyValueError::new_err("new_* arrays differ in length"));
    }
    let new_requests = (0..n)
        .map(|i| NewRequestPlan {
            slot: new_slots[i],
            sampling: SamplingParams {
                temperature: temp[i],
                top_p: top_p[i],
                top_k: top_k[i] as i32,
                min_p: min_p[i],
                repetition_penalty: rep[i],
                frequency_penalty: freq[i],
                presence_penalty: pres[i],
                seed: (seed[i] >= 0).then_some(seed[i] as u64),
                top_logprobs: top_lp[i] as u32,
            },
        })
        .collect();
    let (pt_slots, pt_first, pt_count) = (
        u32s(&v, "pt_slots")?,
        u32s(&v, "pt_first")?,
        u32s(&v, "pt_count")?,
    );
    let pages = u32s(&v, "pt_pages")?;
    if pt_first.len() != pt_slots.len() || pt_count.len() != pt_slots.len() {
        return Err(PyValueError::new_err("pt_* arrays differ in length"));
    }
    if pt_count.iter().map(|&c| c as usize).sum::<usize>() != pages.len() {
        return Err(PyValueError::new_err(
            "pt_count does not add up to len(pt_pages)",
        ));
    }
    let mut pages = pages.into_iter();
    let page_table_updates = (0..pt_slots.len())
        .map(|i| PageTableUpdate {
            slot: pt_slots[i],
            first_index: pt_first[i],
            pages: pages.by_ref().take(pt_count[i] as usize).collect(),
        })
        .collect();
    let slots = u32s(&v, "slots")?;
    let (ntok, start, cached) = (
        u32s(&v, "num_tokens")?,
        u32s(&v, "start_pos")?,
        u32s(&v, "cached_len")?,
    );
    let sample = ints(&v, "sample", None)?;
    if ntok.len() != slots.len() || start.len() != slots.len() || sample.len() != slots.len() {
        return Err(PyValueError::new_err(
            "slots/num_tokens/start_pos/sample differ in length",
        ));
    }
    let scheduled = (0..slots.len())
        .map(|i| ScheduledRequest {
            slot: slots[i],
            num_tokens: ntok[i],
            start_pos: start[i],
            cached_len: cached.get(i).copied().unwrap_or(0),
            sample: sample[i] != 0,
        })
        .collect();
    Ok(Plan {
        step_id: v.get("step_id").and_then(Value::as_u64).unwrap_or(0),
        finished_slots: u32s(&v, "finished_slots")?,
        new_requests,
        page_table_updates,
        scheduled,
        input_ids: u32s(&v, "input_ids")?,
    })
}

#[pymethods]
impl TestWriter {
    /// Sends a plan given as JSON with the keys of `StepPlan` (GIL released while blocked).
    #[pyo3(signature = (json, timeout_ms=Some(10_000)))]
    fn send_plan_json(&self, py: Python<'_>, json: &str, timeout_ms: Option<u64>) -> PyResult<()> {
        let plan = plan_from_json(json)?;
        with_writer(self, |ch| {
            py.allow_threads(|| ch.send_plan(&plan, ms(timeout_ms)))
                .map_err(to_py)
        })
    }

    /// The next result as a dict (step_id, slots, tokens, logprobs, top_ids, top_logprobs;
    /// the top_* as lists of lists, padding dropped), or None after `timeout_ms`.
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
        let d = PyDict::new(py);
        let s = &r.sampled;
        d.set_item("step_id", r.step_id)?;
        d.set_item("slots", s.iter().map(|e| e.slot).collect::<Vec<_>>())?;
        d.set_item("tokens", s.iter().map(|e| e.token).collect::<Vec<_>>())?;
        d.set_item("logprobs", s.iter().map(|e| e.logprob).collect::<Vec<_>>())?;
        let ids = s
            .iter()
            .map(|e| e.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>());
        d.set_item("top_ids", PyList::new(py, ids)?)?;
        let lps = s
            .iter()
            .map(|e| e.top_logprobs.iter().map(|t| t.1).collect::<Vec<_>>());
        d.set_item("top_logprobs", PyList::new(py, lps)?)?;
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
        let ch = py.allow_threads(|| lock(&self.inner).take());
        drop(ch);
    }
}

/// Creates a channel `name` for `n_readers` ranks and returns its writing end (tests only).
#[pyfunction]
#[pyo3(signature = (name, n_readers=1, slots=8, slot_bytes=1 << 20))]
fn create_test_writer(
    name: &str,
    n_readers: u32,
    slots: u32,
    slot_bytes: u32,
) -> PyResult<TestWriter> {
    let ch = PlanChannel::create(name, slots, slot_bytes, n_readers).map_err(to_py)?;
    Ok(TestWriter {
        inner: Mutex::new(Some(ch)),
    })
}

/// Adds the channel classes, `create_test_writer`, `ChannelShutdown` and `LAST_SAMPLED` (the
/// input id a plan uses for "this slot's last sampled token") to `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LAST_SAMPLED", tokenspeed_engine::LAST_SAMPLED)?;
    m.add_class::<WorkerChannel>()?;
    m.add_class::<TestWriter>()?;
    m.add_function(wrap_pyfunction!(create_test_writer, m)?)?;
    m.add("ChannelShutdown", m.py().get_type::<ChannelShutdown>())?;
    Ok(())
}
