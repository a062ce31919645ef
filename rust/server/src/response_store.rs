//! Stored `/v1/responses` answers (`store: true`, the default): what `previous_response_id`
//! continues from and what `GET` / `DELETE /v1/responses/{id}` read. In memory and bounded:
//! past `capacity` entries the least recently used one is forgotten (a later reference to it
//! is a 404, as for an id that never existed).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::{Map, Value};

/// How many responses are kept. Each holds its conversation, so this bounds the memory a
/// stream of stored requests can take; a client chaining turns only needs the latest few.
pub const CAPACITY: usize = 1024;

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object, as the route rendered it.
    pub response: Value,
    /// The whole conversation in chat-message form, this response's output included (its
    /// `instructions` are not: OpenAI does not carry them over to the next turn).
    pub messages: Vec<Map<String, Value>>,
}

pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Lru>,
}

#[derive(Default)]
struct Lru {
    entries: HashMap<String, StoredResponse>,
    /// Ids, least recently used first.
    order: VecDeque<String>,
}

impl Lru {
    fn touch(&mut self, id: &str) {
        if let Some(at) = self.order.iter().position(|k| k == id) {
            if let Some(k) = self.order.remove(at) {
                self.order.push_back(k);
            }
        }
    }
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(CAPACITY)
    }
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        ResponseStore {
            capacity: capacity.max(1),
            inner: Mutex::new(Lru::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        // A panic while holding the lock leaves consistent data (each step is one call).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn put(&self, id: String, stored: StoredResponse) {
        let mut lru = self.lock();
        if lru.entries.insert(id.clone(), stored).is_some() {
            lru.touch(&id);
            return;
        }
        lru.order.push_back(id);
        while lru.order.len() > self.capacity {
            if let Some(old) = lru.order.pop_front() {
                lru.entries.remove(&old);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<StoredResponse> {
        let mut lru = self.lock();
        let found = lru.entries.get(id).cloned();
        if found.is_some() {
            lru.touch(id);
        }
        found
    }

    /// Whether `id` was stored.
    pub fn delete(&self, id: &str) -> bool {
        let mut lru = self.lock();
        if lru.entries.remove(id).is_none() {
            return false;
        }
        lru.order.retain(|k| k != id);
        true
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(n: i64) -> StoredResponse {
        StoredResponse {
            response: Value::from(n),
            messages: Vec::new(),
        }
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let store = ResponseStore::new(2);
        store.put("a".into(), stored(1));
        store.put("b".into(), stored(2));
        assert!(store.get("a").is_some()); // a is now the most recent
        store.put("c".into(), stored(3));
        assert!(store.get("b").is_none(), "b was the least recently used");
        assert_eq!(store.get("a").map(|s| s.response), Some(Value::from(1)));
        assert_eq!(store.len(), 2);
        assert!(store.delete("a"));
        assert!(!store.delete("a"));
        assert_eq!(store.len(), 1);
    }
}
