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
                spec_ahead_steps: s.spec_ahead_steps,
                host: s.host,
                storage: s.storage,
                kv_transfer: s.kv_transfer,
            };
        }
    }
}

impl EngineStats {
    /// The totals over data-parallel replicas (the largest batch is the largest of any).
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a EngineStats>) -> EngineStats {
        all.into_iter()
            .fold(EngineStats::default(), |t, s| EngineStats {
                total_pages: t.total_pages + s.total_pages,
                free_pages: t.free_pages + s.free_pages,
                used_pages: t.used_pages + s.used_pages,
                cached_pages: t.cached_pages + s.cached_pages,
                evictable_pages: t.evictable_pages + s.evictable_pages,
                running_requests: t.running_requests + s.running_requests,
                waiting_requests: t.waiting_requests + s.waiting_requests,
                steps: t.steps + s.steps,
                max_batch_size: t.max_batch_size.max(s.max_batch_size),
                last_batch_size: t.last_batch_size + s.last_batch_size,
                last_step_tokens: t.last_step_tokens + s.last_step_tokens,
                busy_s: t.busy_s + s.busy_s,
                stalled_s: t.stalled_s + s.stalled_s,
                gpu_idle_s: t.gpu_idle_s + s.gpu_idle_s,
                prefix_cache_queries: t.prefix_cache_queries + s.prefix_cache_queries,
                prefix_cache_hits: t.prefix_cache_hits + s.prefix_cache_hits,
                retractions: t.retractions + s.retractions,
                spec_draft_tokens: t.spec_draft_tokens + s.spec_draft_tokens,
                spec_accepted_tokens: t.spec_accepted_tokens + s.spec_accepted_tokens,
                spec_verify_steps: t.spec_verify_steps + s.spec_verify_steps,
                spec_enabled: t.spec_enabled || s.spec_enabled,
                spec_off_steps: t.spec_off_steps + s.spec_off_steps,
                spec_ahead_steps: t.spec_ahead_steps + s.spec_ahead_steps,
                host: tokenspeed_engine::HostStats {
                    total_pages: t.host.total_pages + s.host.total_pages,
                    used_pages: t.host.used_pages + s.host.used_pages,
                    hit_tokens: t.host.hit_tokens + s.host.hit_tokens,
                    load_pages: t.host.load_pages + s.host.load_pages,
                    writeback_pages: t.host.writeback_pages + s.host.writeback_pages,
                },
                storage: t.storage.plus(&s.storage),
                kv_transfer: t.kv_transfer.plus(&s.kv_transfer),
            })
    }

    /// The pool counts in the scheduler's terms (for the Prometheus gauges).
    pub fn pool(&self) -> tokenspeed_engine::scheduler::SchedulerStats {
        tokenspeed_engine::scheduler::SchedulerStats {
            total_pages: self.total_pages,
            free_pages: self.free_pages,
            used_pages: self.used_pages,
            cached_pages: self.cached_pages,
            evictable_pages: self.evictable_pages,
            running: self.running_requests,
            waiting: self.waiting_requests,
            retractions: self.retractions,
            spec_draft_tokens: self.spec_draft_tokens,
            spec_accepted_tokens: self.spec_accepted_tokens,
            spec_verify_steps: self.spec_verify_steps,
            spec_enabled: self.spec_enabled,
            spec_off_steps: self.spec_off_steps,
            spec_ahead_steps: self.spec_ahead_steps,
            host: self.host,
            storage: self.storage,
            kv_transfer: self.kv_transfer,
        }
    }
}
