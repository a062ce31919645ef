//! Series of KV that moves between places: the radix cache's host tier
//! (`--enable-hierarchical-cache`: slots, slots in use, running totals of host-hit tokens and of
//! pages loaded / written back), its storage tier (`--hicache-storage-backend`: pages, pages in
//! use, hit tokens, pages stored / fetched), and PD disaggregation's transfers
//! (`--disaggregation-mode`: requests and pages sent by a prefill server, received by a decode
//! server). All zero when the feature is off.

use prometheus::{IntCounter, IntGauge};
use tokenspeed_engine::scheduler::SchedulerStats;

use super::Builder;

pub(super) struct KvMoveSeries {
    host_kv_pages: IntGauge,
    host_kv_pages_used: IntGauge,
    host_hit_tokens: IntCounter,
    host_load_pages: IntCounter,
    host_writeback_pages: IntCounter,
    storage_kv_pages: IntGauge,
    storage_kv_pages_used: IntGauge,
    storage_hit_tokens: IntCounter,
    storage_store_pages: IntCounter,
    storage_fetch_pages: IntCounter,
    kv_transfer_sent_requests: IntCounter,
    kv_transfer_sent_pages: IntCounter,
    kv_transfer_received_requests: IntCounter,
    kv_transfer_received_pages: IntCounter,
}

impl KvMoveSeries {
    pub(super) fn new(b: &Builder) -> Self {
        KvMoveSeries {
            host_kv_pages: b.gauge("host_kv_pages", "Host KV slots of the hierarchical cache"),
            host_kv_pages_used: b.gauge(
                "host_kv_pages_used",
                "Host KV slots holding cached prefixes",
            ),
            host_hit_tokens: b.counter(
                "host_hit_tokens_total",
                "Prefix tokens found in host memory and loaded back instead of recomputed",
            ),
            host_load_pages: b.counter(
                "host_load_pages_total",
                "KV pages copied from host memory to the device",
            ),
            host_writeback_pages: b.counter(
                "host_writeback_pages_total",
                "KV pages copied from the device to host memory",
            ),
            storage_kv_pages: b.gauge(
                "storage_kv_pages",
                "KV pages the hierarchical cache's storage tier may hold",
            ),
            storage_kv_pages_used: b
                .gauge("storage_kv_pages_used", "KV pages held in the storage tier"),
            storage_hit_tokens: b.counter(
                "storage_hit_tokens_total",
                "Prefix tokens found in the storage tier and fetched instead of recomputed",
            ),
            storage_store_pages: b.counter(
                "storage_store_pages_total",
                "KV pages written from host memory to the storage tier",
            ),
            storage_fetch_pages: b.counter(
                "storage_fetch_pages_total",
                "KV pages read from the storage tier into host memory",
            ),
            kv_transfer_sent_requests: b.counter(
                "kv_transfer_sent_requests_total",
                "Requests whose prompt KV this prefill server sent to its decode server",
            ),
            kv_transfer_sent_pages: b.counter(
                "kv_transfer_sent_pages_total",
                "KV pages this prefill server sent to its decode server",
            ),
            kv_transfer_received_requests: b.counter(
                "kv_transfer_received_requests_total",
                "Requests whose prompt KV this decode server received instead of computing it",
            ),
            kv_transfer_received_pages: b.counter(
                "kv_transfer_received_pages_total",
                "KV pages this decode server received from its prefill server",
            ),
        }
    }

    /// Sets the gauges and brings the counters up to the scheduler's running totals.
    pub(super) fn observe(&self, s: &SchedulerStats) {
        let (h, st, pd) = (&s.host, &s.storage, &s.kv_transfer);
        self.host_kv_pages.set(h.total_pages as i64);
        self.host_kv_pages_used.set(h.used_pages as i64);
        self.storage_kv_pages.set(st.total_pages as i64);
        self.storage_kv_pages_used.set(st.used_pages as i64);
        for (counter, total) in [
            (&self.host_hit_tokens, h.hit_tokens),
            (&self.host_load_pages, h.load_pages),
            (&self.host_writeback_pages, h.writeback_pages),
            (&self.storage_hit_tokens, st.hit_tokens),
            (&self.storage_store_pages, st.store_pages),
            (&self.storage_fetch_pages, st.fetch_pages),
            (&self.kv_transfer_sent_requests, pd.sent_requests),
            (&self.kv_transfer_sent_pages, pd.sent_pages),
            (&self.kv_transfer_received_requests, pd.received_requests),
            (&self.kv_transfer_received_pages, pd.received_pages),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }
}
