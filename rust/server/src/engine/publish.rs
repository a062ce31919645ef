//! What the engine thread tells the rest of the server about its state: the `EngineStats`
//! behind /get_server_info and /metrics, and the radix cache's KV events.

use tokenspeed_engine::scheduler::SchedulerStats;

use super::event_loop::EngineLoop;
use super::*;

impl EngineLoop {
    /// Hands the radix cache's KV events since the last call to the publisher
    /// (`--kv-events-config`); off, the cache records none and this returns at once.
    pub(super) fn publish_kv_events(&mut self) {
        if let Some(sink) = &self.options.kv_events {
            let events = self.scheduler.take_kv_events();
            if !events.is_empty() {
                sink.publish(events);
            }
        }
    }

    pub(super) fn publish_stats(&mut self, batch: usize, tokens: usize) {
        let s: SchedulerStats = self.scheduler.stats();
        if self.options.pool_metrics {
            self.metrics.observe_pool(&s);
        }
        if let Ok(mut stats) = self.stats.lock() {
            *stats = EngineStats {
                total_pages: s.total_pages,
                free_pages: s.free_pages,
                used_pages: s.used_pages,
                cached_pages: s.cached_pages,
                evictable_pages: s.evictable_pages,
                running_requests: s.running,
                waiting_requests: s.waiting,
                steps: self.steps,
                max_batch_size: self.max_batch,
                last_batch_size: batch,
                last_step_tokens: tokens,
                busy_s: self.busy.as_secs_f64(),
                stalled_s: self.stalled.as_secs_f64(),
                gpu_idle_s: self.gpu_idle.as_secs_f64(),
                prefix_cache_queries: self.prefix_queries,
                prefix_cache_hits: self.prefix_hits,
                retractions: s.retractions,
                spec_draft_tokens: s.spec_draft_tokens,
                spec_accepted_tokens: s.spec_accepted_tokens,
                spec_verify_steps: s.spec_verify_steps,
                spec_enabled: s.spec_enabled,
                spec_off_steps: s.spec_off_steps,
                host: s.host,
                storage: s.storage,
                kv_transfer: s.kv_transfer,
            };
        }
    }
}
