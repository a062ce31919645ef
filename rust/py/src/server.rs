//! Server-side bindings: create the plan channel before spawning workers, then `serve`.

use std::sync::Mutex;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tokenspeed_ipc::PlanChannel;
use tokenspeed_server::worker_link::ShmWorkerLink;
use tokenspeed_server::{ServerConfig, WorkerLink};

/// The server's end of the shared-memory channel. Created by the launcher so that workers can
/// attach while they load the model; `serve` takes it over.
#[pyclass(module = "tokenspeed._core")]
pub struct ServerChannel {
    inner: Mutex<Option<PlanChannel>>,
    name: String,
}

#[pymethods]
impl ServerChannel {
    #[staticmethod]
    fn create(name: &str, n_readers: u32, slots: u32, slot_bytes: u32) -> PyResult<Self> {
        let channel = PlanChannel::create(name, slots, slot_bytes, n_readers)
            .map_err(|e| PyRuntimeError::new_err(format!("creating channel {name}: {e}")))?;
        Ok(ServerChannel {
            name: channel.name().to_string(),
            inner: Mutex::new(Some(channel)),
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Shuts the channel down (workers waiting on it exit) and unlinks it. Idempotent.
    fn close(&self) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.take();
        }
    }
}

/// Serves HTTP until SIGINT/SIGTERM. Releases the GIL for the whole run. `channels`: one
/// ServerChannel, or a list of them, one per data-parallel replica (`worker_pids` in the config
/// then lists replica 0's ranks, then replica 1's, ...).
#[pyfunction]
#[pyo3(signature = (config_json, channels, log_level = "info"))]
fn serve(
    py: Python<'_>,
    config_json: &str,
    channels: &Bound<'_, PyAny>,
    log_level: &str,
) -> PyResult<()> {
    let (config, links) = take_links(config_json, channels)?;
    tokenspeed_server::init_logging(log_level);
    py.allow_threads(|| tokenspeed_server::serve(config, links))
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The core's config and one worker link per replica, each taking over its ServerChannel:
/// what both `serve` and the in-process `Engine` start from.
pub(crate) fn take_links(
    config_json: &str,
    channels: &Bound<'_, PyAny>,
) -> PyResult<(ServerConfig, Vec<Box<dyn WorkerLink>>)> {
    let config: ServerConfig = serde_json::from_str(config_json)
        .map_err(|e| PyValueError::new_err(format!("server config: {e}")))?;
    let channels: Vec<PyRef<'_, ServerChannel>> = match channels.extract() {
        Ok(one) => vec![one],
        Err(_) => channels.extract()?,
    };
    let dp = channels.len().max(1);
    if !config.worker_pids.len().is_multiple_of(dp) {
        return Err(PyValueError::new_err(format!(
            "{} worker pids do not split over {dp} replicas",
            config.worker_pids.len()
        )));
    }
    let per_replica = config.worker_pids.len() / dp;
    let mut links: Vec<Box<dyn WorkerLink>> = Vec::with_capacity(dp);
    for (r, channel) in channels.iter().enumerate() {
        let plan_channel = channel
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("channel lock poisoned"))?
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("the channel was already used or closed"))?;
        let pids = config.worker_pids[r * per_replica..(r + 1) * per_replica].to_vec();
        links.push(Box::new(ShmWorkerLink::new(plan_channel, pids)));
    }
    Ok((config, links))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ServerChannel>()?;
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    Ok(())
}
