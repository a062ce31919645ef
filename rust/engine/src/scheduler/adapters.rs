//! LoRA adapter slots. The worker's pool holds `--max-loras-per-batch` adapters and every
//! running request is in every step, so the distinct adapters of the running requests must fit
//! the pool, beside the pinned adapters, which keep their slot whether or not they run.

use std::collections::HashSet;

/// What admission may hand out of the worker's adapter pool.
#[derive(Debug, Clone)]
pub(super) struct AdapterSlots {
    /// `--max-loras-per-batch` (usize::MAX: LoRA off).
    pub max: usize,
    /// The pinned adapters' ids, ascending (the server's registry decides them).
    pub pins: Vec<u32>,
}

impl AdapterSlots {
    pub fn unlimited() -> Self {
        AdapterSlots {
            max: usize::MAX,
            pins: Vec::new(),
        }
    }

    /// Whether a request on `adapter` (0: the base model, which takes no slot) may join
    /// requests running on `running`: after it, the running adapters and the pinned ones
    /// must fit the pool. While a new pin leaves them over it, no other adapter starts until
    /// enough running ones have finished.
    pub fn admits(&self, running: &HashSet<u32>, adapter: u32) -> bool {
        if adapter == 0 || running.contains(&adapter) {
            return true;
        }
        let reserved = self
            .pins
            .iter()
            .filter(|&&p| p != adapter && !running.contains(&p))
            .count();
        running.len() + 1 + reserved <= self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_adapters_keep_their_slot_whether_or_not_they_run() {
        let slots = AdapterSlots {
            max: 3,
            pins: vec![9],
        };
        let running: HashSet<u32> = [1].into();
        assert!(slots.admits(&running, 2), "1, 2 and pinned 9 fill 3 slots");
        assert!(
            slots.admits(&running, 9),
            "the pinned one always has its slot"
        );
        assert!(slots.admits(&running, 0), "the base model takes none");
        let two: HashSet<u32> = [1, 2].into();
        assert!(!slots.admits(&two, 3), "3 would take pinned 9's slot");
        assert!(slots.admits(&two, 9));
        assert!(slots.admits(&[1, 2, 9].into(), 1));
    }

    #[test]
    fn a_pin_past_the_running_adapters_holds_back_every_new_adapter() {
        // Three adapters ran when 9 was pinned: 9 waits too, until one of them is done.
        let slots = AdapterSlots {
            max: 3,
            pins: vec![9],
        };
        let full: HashSet<u32> = [1, 2, 3].into();
        assert!(!slots.admits(&full, 9));
        assert!(!slots.admits(&full, 4));
        assert!(
            slots.admits(&full, 2),
            "running adapters' requests go ahead"
        );
        assert!(slots.admits(&[1, 2].into(), 9));
    }
}
