//! The server's lifecycle as the HTTP layer sees it: whether it is draining (shutting down),
//! and how many generating requests are in flight (admission control and the drain wait).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct Lifecycle {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    max_in_flight: usize,
}

/// One admitted request; releases its slot when dropped.
pub struct Admitted(Arc<Lifecycle>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Lifecycle {
    pub fn new(max_in_flight: usize) -> Self {
        Lifecycle {
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            max_in_flight: max_in_flight.max(1),
        }
    }

    /// A slot for one more generating request, or None when `max_in_flight` are in flight.
    pub fn try_admit(self: &Arc<Self>) -> Option<Admitted> {
        let admitted = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_in_flight).then_some(n + 1)
            })
            .is_ok();
        admitted.then(|| Admitted(self.clone()))
    }

    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Resolves when no generating request is in flight (polled: this runs once, at shutdown).
    pub async fn wait_idle(&self) {
        while self.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_frees_on_drop() {
        let l = Arc::new(Lifecycle::new(2));
        let a = l.try_admit().expect("first");
        let b = l.try_admit().expect("second");
        assert!(l.try_admit().is_none());
        drop(a);
        assert_eq!(l.in_flight(), 1);
        let _c = l.try_admit().expect("after a release");
        drop(b);
        assert_eq!(l.in_flight(), 1);
    }
}
