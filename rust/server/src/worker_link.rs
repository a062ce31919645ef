//! The production `WorkerLink`: the shared-memory plan/result channel plus a watch on the
//! worker processes, so a dead worker fails requests instead of hanging them.

use std::time::Duration;

use tokenspeed_engine::{Plan, StepResult};
use tokenspeed_ipc::{IpcError, PlanChannel};

use crate::engine::{LinkError, WorkerLink};

pub struct ShmWorkerLink {
    channel: PlanChannel,
    worker_pids: Vec<i32>,
}

impl ShmWorkerLink {
    pub fn new(channel: PlanChannel, worker_pids: Vec<i32>) -> Self {
        ShmWorkerLink {
            channel,
            worker_pids,
        }
    }
}

fn channel_error(e: IpcError) -> LinkError {
    LinkError::Channel(e.to_string())
}

/// True while `pid` runs. Reaps it if it is our child that exited (so it can't linger as a zombie).
fn process_alive(pid: i32) -> bool {
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG only reads/writes `status`.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    match r {
        0 => true,
        r if r == pid => false,
        // Not our child (ECHILD): fall back to a signal-0 probe.
        // SAFETY: kill with signal 0 sends nothing; it only checks the pid.
        _ => unsafe { libc::kill(pid, 0) == 0 },
    }
}

impl WorkerLink for ShmWorkerLink {
    fn send_plan(&mut self, plan: &Plan) -> Result<(), LinkError> {
        // The ring has several slots and workers release a slot at their next receive, so a
        // full ring means a stuck worker: wait in short rounds and check liveness in between.
        loop {
            match self
                .channel
                .send_plan(plan, Some(Duration::from_millis(200)))
            {
                Ok(()) => return Ok(()),
                Err(IpcError::Timeout) => self.check_alive()?,
                Err(e) => return Err(channel_error(e)),
            }
        }
    }

    fn recv_result(&mut self, timeout: Duration) -> Result<Option<StepResult>, LinkError> {
        self.channel
            .recv_result(Some(timeout))
            .map_err(channel_error)
    }

    fn check_alive(&mut self) -> Result<(), LinkError> {
        for &pid in &self.worker_pids {
            if !process_alive(pid) {
                return Err(LinkError::WorkerDied { pid });
            }
        }
        Ok(())
    }
}
