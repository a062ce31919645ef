//! The radix cache's self-check: every node's bookkeeping against the tree and both page pools,
//! run by the tests after each operation (kept apart from the cache's own operations).

use super::*;

impl RadixCache {
    /// Checks the tree's bookkeeping; used by tests. Returns a description of the first fault.
    pub fn check_invariants(&self) -> Result<(), String> {
        let ps = self.page_size;
        let (mut cached, mut locked, mut host_cached) = (0, 0, 0);
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            let host_len = node.host.as_ref().map(Pages::len);
            let on_device = node.key.len() == node.pages.len() * ps;
            let on_host = host_len.is_some_and(|h| h * ps == node.key.len());
            if !(on_device && (host_len.is_none() || on_host))
                && !(node.pages.is_empty() && on_host)
            {
                return Err(format!("node {i}: key/pages length mismatch"));
            }
            if i != 0 && node.key.is_empty() {
                return Err(format!("node {i}: empty non-root node"));
            }
            if let Some(h) = &node.host {
                host_cached += h.len();
                if let Some(tier) = &self.host {
                    if h.ids().iter().any(|&p| tier.pool.is_free(p)) {
                        return Err(format!(
                            "node {i}: holds a host slot the pool thinks is free"
                        ));
                    }
                }
            }
            if node.pages.is_empty() && i != 0 {
                if node.lock > 0 {
                    return Err(format!("node {i}: locked on the host"));
                }
                if node
                    .children
                    .values()
                    .any(|c| !self.node(*c).pages.is_empty())
                {
                    return Err(format!("node {i}: on the host above a device child"));
                }
            }
            let child_locks: u32 = node.children.values().map(|c| self.node(*c).lock).sum();
            if i != 0 && node.lock < child_locks {
                return Err(format!("node {i}: lock below its children's locks"));
            }
            for (first, c) in &node.children {
                let child = self.node(*c);
                let key = child_key(NodeId(i as u32), child.ns, &child.key[..ps]);
                if child.parent != Some(NodeId(i as u32)) || &key != first {
                    return Err(format!("node {i}: child {} mis-linked", c.0));
                }
            }
            cached += node.pages.len();
            if node.lock > 0 {
                locked += node.pages.len();
            }
            if node.pages.ids().iter().any(|&p| self.pool.is_free(p)) {
                return Err(format!("node {i}: holds a page the pool thinks is free"));
            }
        }
        if self.host.as_ref().map_or(0, |t| t.cached) != host_cached {
            return Err(format!("host counter: counted {host_cached}"));
        }
        if cached != self.cached_pages || locked != self.locked_pages {
            return Err(format!(
                "counters: cached {} (counted {cached}), locked {} (counted {locked})",
                self.cached_pages, self.locked_pages
            ));
        }
        Ok(())
    }
}
