//! The KV page pool: the single owner of page ids, lending them out through move-only `Pages`.
//!
//! A page id is either in the pool's free list or inside exactly one `Pages` handle. Handles are
//! not `Clone`, and dropping one returns its ids, so a double free or a leak cannot be written
//! without `unsafe` or `mem::forget`. The pool is shared through `Rc<RefCell<..>>`: the engine
//! is single-threaded (the scheduler lives on its engine thread), so no lock is needed.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

struct PoolInner {
    /// Free ids, used as a stack; seeded so the lowest ids come out first (deterministic tests).
    free: Vec<u32>,
    /// `is_free[id]`: a cross-check that catches a page returned twice (a bug in this module).
    is_free: Vec<bool>,
}

impl PoolInner {
    fn release(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            let slot = &mut self.is_free[id as usize];
            assert!(!*slot, "page {id} returned to the pool twice");
            *slot = true;
            self.free.push(id);
        }
    }
}

/// The pool of KV pages `0..total`. Cloning it clones the *reference*, not the pages.
#[derive(Clone)]
pub struct PagePool {
    inner: Rc<RefCell<PoolInner>>,
}

impl PagePool {
    pub fn new(total: u32) -> Self {
        PagePool {
            inner: Rc::new(RefCell::new(PoolInner {
                free: (0..total).rev().collect(),
                is_free: vec![true; total as usize],
            })),
        }
    }

    /// Takes `n` pages, or none at all if fewer than `n` are free.
    pub fn alloc(&self, n: usize) -> Option<Pages> {
        let mut inner = self.inner.borrow_mut();
        if inner.free.len() < n {
            return None;
        }
        let at = inner.free.len() - n;
        // Reverse so the handle lists ids in the order they left the stack (lowest first).
        let ids: Vec<u32> = inner.free.drain(at..).rev().collect();
        for &id in &ids {
            inner.is_free[id as usize] = false;
        }
        Some(Pages {
            ids,
            pool: Rc::clone(&self.inner),
        })
    }

    /// An empty handle bound to this pool (a starting point to `append` into).
    pub fn empty(&self) -> Pages {
        Pages {
            ids: Vec::new(),
            pool: Rc::clone(&self.inner),
        }
    }

    pub fn free_count(&self) -> usize {
        self.inner.borrow().free.len()
    }

    pub fn total(&self) -> usize {
        self.inner.borrow().is_free.len()
    }

    /// Pages currently held by some handle.
    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    pub fn is_free(&self, id: u32) -> bool {
        self.inner
            .borrow()
            .is_free
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("total", &self.total())
            .field("free", &self.free_count())
            .finish()
    }
}

/// A run of KV pages owned by whoever holds this value; dropping it returns them to the pool.
pub struct Pages {
    ids: Vec<u32>,
    pool: Rc<RefCell<PoolInner>>,
}

impl Pages {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Keeps `[0, at)` and returns `[at, len)` as a separate handle (`at` is clamped to `len`).
    pub fn split_off(&mut self, at: usize) -> Pages {
        let at = at.min(self.ids.len());
        Pages {
            ids: self.ids.split_off(at),
            pool: Rc::clone(&self.pool),
        }
    }

    /// Returns the first `n` pages (clamped to `len`) to the pool and keeps the rest: a
    /// sliding-window layer's pages that fell out of the window (`scheduler/swa.rs`).
    pub fn release_front(&mut self, n: usize) {
        let rest = self.split_off(n);
        drop(std::mem::replace(self, rest));
    }

    /// Moves `other`'s pages to the end of this handle.
    ///
    /// # Panics
    /// If `other` comes from a different pool: mixing pools would return ids to the wrong owner.
    pub fn append(&mut self, mut other: Pages) {
        assert!(
            Rc::ptr_eq(&self.pool, &other.pool),
            "Pages::append across two pools"
        );
        self.ids.append(&mut other.ids);
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.pool.borrow_mut().release(&self.ids);
        }
    }
}

impl fmt::Debug for Pages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Pages").field(&self.ids).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_hands_out_distinct_lowest_ids_first() {
        let pool = PagePool::new(8);
        let a = pool.alloc(3).expect("3 of 8 free");
        let b = pool.alloc(2).expect("2 of 5 free");
        assert_eq!(a.ids(), &[0, 1, 2]);
        assert_eq!(b.ids(), &[3, 4]);
        assert_eq!(pool.free_count(), 3);
        assert_eq!(pool.used_count(), 5);
    }

    #[test]
    fn alloc_is_all_or_nothing() {
        let pool = PagePool::new(4);
        let _held = pool.alloc(3);
        assert!(pool.alloc(2).is_none());
        assert_eq!(pool.free_count(), 1, "a failed alloc takes nothing");
    }

    #[test]
    fn dropping_a_handle_returns_its_pages() {
        let pool = PagePool::new(4);
        let pages = pool.alloc(4).expect("all free");
        assert_eq!(pool.free_count(), 0);
        drop(pages);
        assert_eq!(pool.free_count(), 4);
        assert!((0..4).all(|id| pool.is_free(id)));
    }

    #[test]
    fn split_and_append_move_ownership_without_freeing() {
        let pool = PagePool::new(6);
        let mut a = pool.alloc(4).expect("free");
        let tail = a.split_off(1);
        assert_eq!(a.ids(), &[0]);
        assert_eq!(tail.ids(), &[1, 2, 3]);
        assert_eq!(pool.free_count(), 2, "splitting frees nothing");

        let mut acc = pool.empty();
        acc.append(tail);
        acc.append(pool.alloc(2).expect("2 free"));
        assert_eq!(acc.ids(), &[1, 2, 3, 4, 5]);
        drop(a);
        assert_eq!(pool.free_count(), 1);
        drop(acc);
        assert_eq!(pool.free_count(), 6, "every page came back exactly once");
    }

    #[test]
    fn release_front_frees_the_oldest_pages_only() {
        let pool = PagePool::new(5);
        let mut a = pool.alloc(4).expect("free");
        a.release_front(3);
        assert_eq!(a.ids(), &[3]);
        assert_eq!(pool.free_count(), 4);
        a.release_front(9);
        assert!(a.is_empty());
        assert_eq!(pool.free_count(), 5, "clamped: every page back once");
    }

    #[test]
    fn split_off_past_the_end_yields_an_empty_handle() {
        let pool = PagePool::new(2);
        let mut a = pool.alloc(2).expect("free");
        let rest = a.split_off(5);
        assert!(rest.is_empty());
        assert_eq!(a.len(), 2);
    }

    #[test]
    #[should_panic(expected = "across two pools")]
    fn append_refuses_pages_of_another_pool() {
        let p1 = PagePool::new(1);
        let p2 = PagePool::new(1);
        let mut a = p1.empty();
        a.append(p2.alloc(1).expect("free"));
    }

    #[test]
    fn pages_freed_in_any_order_are_reusable() {
        let pool = PagePool::new(5);
        let mut handles: Vec<Pages> = (0..5).map(|_| pool.alloc(1).expect("free")).collect();
        handles.swap(0, 3);
        handles.truncate(2);
        let again = pool.alloc(3).expect("3 were returned");
        let mut ids: Vec<u32> = handles
            .iter()
            .chain([&again])
            .flat_map(|p| p.ids().to_vec())
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2, 3, 4], "no id is handed out twice");
    }
}
