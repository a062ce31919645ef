//! Python class for the worker side of the shm channel (`WorkerChannel`) and the schema
//! (array names and dtypes of plans and results) Python reads instead of restating it.
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
use tokenspeed_engine::schema::Message;
use tokenspeed_engine::{Plan, StepLimits, StepResult};
use tokenspeed_ipc::{codec, ChannelStatus, IpcError, WorkerChannel as Channel};

pyo3::create_exception!(
    _core,
    ChannelShutdown,
    PyConnectionError,
    "The server shut the plan channel down (or went away)."
);

/// `PyBUF_READ` from CPython's stable ABI (a read-only memoryview).
const PY_BUF_READ: c_int = 0x100;

pub(crate) fn to_py(e: IpcError) -> PyErr {
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

pub(crate) fn ms(timeout_ms: Option<u64>) -> Option<Duration> {
    timeout_ms.map(Duration::from_millis)
}

/// Locks without blocking: blocking here while holding the GIL could deadlock with a thread
/// that waits (GIL released) while holding the lock. Concurrent use is a caller bug.
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
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
    /// a dict of numpy views keyed by the schema's array names (`plan_schema()`) plus
    /// `step_id`, or None after
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
        let lay = codec::layout_of::<Plan>(payload).map_err(to_py)?;
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
        for a in &lay.arrays {
            let kw = PyDict::new(py);
            kw.set_item("dtype", a.dtype.numpy())?;
            kw.set_item("count", a.count)?;
            kw.set_item("offset", a.offset)?;
            d.set_item(&a.name, frombuffer.call((&mv,), Some(&kw))?)?;
        }
        Ok(Some(d))
    }

    /// Gives the current plan's slot back now (instead of at the next `recv`).
    fn release(&self) -> PyResult<()> {
        try_lock(&self.inner)?.release();
        Ok(())
    }

    /// Sends one step's result (rank 0 only): a dict of schema array name (`result_schema()`)
    /// → little-endian bytes (numpy `.tobytes()`); missing arrays are zeros / empty lists.
    /// Blocks (GIL released) while the result ring is full; raises ValueError for arrays that
    /// disagree with the schema, TimeoutError after `timeout_ms`, ChannelShutdown after
    /// shutdown.
    #[pyo3(signature = (step_id, arrays, timeout_ms=None))]
    fn send_result(
        &self,
        py: Python<'_>,
        step_id: u64,
        arrays: std::collections::HashMap<String, Vec<u8>>,
        timeout_ms: Option<u64>,
    ) -> PyResult<()> {
        let mut guard = try_lock(&self.inner)?;
        let ch: &mut Channel = &mut guard;
        py.allow_threads(|| {
            let get = |name: &str| arrays.get(name).map(Vec::as_slice);
            ch.send_result_arrays(step_id, get, ms(timeout_ms))
        })
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

/// [(array name, numpy dtype)] of `M`, in payload order.
fn schema_of<M: Message>(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let rows: Vec<(String, &str)> = M::array_names()
        .into_iter()
        .map(|(n, d)| (n, d.numpy()))
        .collect();
    PyList::new(py, rows)
}

/// The plan's arrays as `recv()` returns them: [(name, numpy dtype)].
#[pyfunction]
fn plan_schema(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    schema_of::<Plan>(py)
}

/// The result's arrays as `send_result()` takes them: [(name, numpy dtype)].
#[pyfunction]
fn result_schema(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    schema_of::<StepResult>(py)
}

/// Bytes of a shm slot that holds the largest plan and result of a step within these limits
/// (`mask_words`: words of a token mask row, 0 without structured output; `worker_grammars`:
/// grammars travel to the worker, `--grammar-backend xgrammar`; `pooled_dim`: floats of one
/// pooled vector, 0 unless `--is-embedding`; `kv_tiers`: 1 the device, 2 with a host tier,
/// 3 with a storage tier below it; `top_logprobs`: top logprobs per token at most,
/// `--max-logprobs` within the vocabulary, 0: none; `kv_transfer`: prefill/decode
/// disaggregation's page transfers, `--disaggregation-mode`; `max_drafts`: draft tokens one
/// result event proposes, EAGLE-3's chain length, 0: none).
#[pyfunction]
#[pyo3(signature = (max_running, max_step_tokens, max_pages_per_request, mask_words = 0,
                    worker_grammars = false, pooled_dim = 0, kv_tiers = 1, top_logprobs = 0,
                    kv_transfer = false, max_drafts = 0))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per limit
fn slot_bytes(
    max_running: usize,
    max_step_tokens: usize,
    max_pages_per_request: usize,
    mask_words: usize,
    worker_grammars: bool,
    pooled_dim: usize,
    kv_tiers: u8,
    top_logprobs: usize,
    kv_transfer: bool,
    max_drafts: usize,
) -> usize {
    let l = StepLimits {
        max_running,
        max_step_tokens,
        max_pages_per_request,
        mask_words,
        worker_grammars,
        pooled_dim,
        host_copies: kv_tiers >= 2,
        storage_copies: kv_tiers >= 3,
        kv_transfer,
        top_logprobs,
        max_drafts,
    };
    Plan::max_encoded_len(&l).max(StepResult::max_encoded_len(&l))
}

/// The neutral sampling parameters (`SamplingParams::neutral`) as {field: value}: what a
/// request that sets nothing samples with. Python reads these instead of restating them.
#[pyfunction]
fn neutral_sampling(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let plan = Plan {
        new_requests: vec![tokenspeed_engine::SamplingParams::neutral()],
        ..Default::default()
    };
    let mut buf = vec![0u8; plan.encoded_len()];
    plan.encode(&mut buf).map_err(|e| to_py(e.into()))?;
    let lay = Plan::layout_of(&buf).map_err(|e| to_py(e.into()))?;
    let d = PyDict::new(py);
    for a in &lay.arrays {
        let Some(field) = a.name.strip_prefix("new_") else {
            continue;
        };
        if a.count != 1 || field == "slot" || field.ends_with("_len") {
            continue;
        }
        let b = &buf[a.offset..a.offset + a.dtype.size()];
        use tokenspeed_engine::schema::{DType, Scalar};
        match a.dtype {
            DType::F32 => d.set_item(field, f32::get(b))?,
            DType::I32 => d.set_item(field, i32::get(b))?,
            DType::U32 => d.set_item(field, u32::get(b))?,
            DType::I64 => d.set_item(field, i64::get(b))?,
            DType::U8 => d.set_item(field, u8::get(b))?,
        }
    }
    Ok(d)
}

/// Adds the channel class, the schema functions, `ChannelShutdown` and the plan constants
/// (`LAST_SAMPLED`: "this slot's last sampled token"; `NO_SEED`; `GRAMMAR_KINDS`: the
/// `GrammarRow::kind` values by name; `OP_KINDS`: the `WorkerOp::kind` values) to `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LAST_SAMPLED", tokenspeed_engine::LAST_SAMPLED)?;
    m.add("NO_SEED", tokenspeed_engine::NO_SEED)?;
    use tokenspeed_engine::grammar_kind as k;
    let kinds = PyDict::new(m.py());
    for (name, kind) in [
        ("json_schema", k::JSON_SCHEMA),
        ("regex", k::REGEX),
        ("grammar", k::GRAMMAR),
        ("choice", k::CHOICE),
        ("structural_tag", k::STRUCTURAL_TAG),
    ] {
        kinds.set_item(name, kind)?;
    }
    m.add("GRAMMAR_KINDS", kinds)?;
    let ops = PyDict::new(m.py());
    use tokenspeed_engine::op_kind as o;
    for (name, kind) in [
        ("update_weights", o::UPDATE_WEIGHTS),
        ("release_memory", o::RELEASE_MEMORY),
        ("resume_memory", o::RESUME_MEMORY),
    ] {
        ops.set_item(name, kind)?;
    }
    m.add("OP_KINDS", ops)?;
    m.add_class::<WorkerChannel>()?;
    m.add_function(wrap_pyfunction!(plan_schema, m)?)?;
    m.add_function(wrap_pyfunction!(result_schema, m)?)?;
    m.add_function(wrap_pyfunction!(slot_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(neutral_sampling, m)?)?;
    m.add("ChannelShutdown", m.py().get_type::<ChannelShutdown>())?;
    Ok(())
}
