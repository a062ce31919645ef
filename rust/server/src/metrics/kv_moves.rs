//! Series of KV that moves between places: the radix cache's host tier
//! (`--enable-hierarchical-cache`: slots, slots in use, running totals of host-hit tokens and of
//! pages loaded / written back), its storage tier (`--hicache-storage-backend`: pages, pages in
//! use, hit tokens, pages stored / fetched), and PD disaggregation's transfers
//! (`--disaggregation-mode`: requests and pages sent by a prefill server, received by a decode
//! server, and the decode worker's own measure of each transfer that arrived: its time on the
//! wire and bytes). All zero when the feature is off.

use prometheus::{Histogram, IntCounter, IntGauge};
use tokenspeed_engine::scheduler::SchedulerStats;
use tokenspeed_engine::KvArrival;

use super::Builder;

/// Seconds of one transfer on the wire: from 100 µs (a few pages over NVLink) to 10 s.
const KV_TRANSFER_BUCKETS: &[f64] = &[
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

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
    kv_transfer_arrived_requests: IntCounter,
    kv_transfer_arrived_bytes: IntCounter,
    kv_transfer_seconds: Histogram,
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
            kv_transfer_arrived_requests: b.counter(
                "kv_transfer_arrived_requests_total",
                "Requests whose KV transfer arrived at this decode server's worker",
            ),
            kv_transfer_arrived_bytes: b.counter(
                "kv_transfer_arrived_bytes_total",
                "Bytes of the KV transfers that arrived (the first rank's share: its TP heads)",
            ),
            kv_transfer_seconds: b.histogram(
                "kv_transfer_seconds",
                "Time of one arrived KV transfer on the wire (first rank: header to last byte)",
                KV_TRANSFER_BUCKETS.to_vec(),
            ),
        }
    }

    /// Each transfer a step result reports arrived: its time on the wire (the counters follow
    /// the scheduler's totals, `observe`).
    pub(super) fn observe_arrivals(&self, arrivals: &[KvArrival]) {
        for a in arrivals {
            let seconds = f64::from(a.transfer_us) / 1e6;
            self.kv_transfer_seconds.observe(seconds);
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
            (&self.kv_transfer_arrived_requests, pd.arrived_requests),
            (&self.kv_transfer_arrived_bytes, pd.arrived_bytes),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use tokenspeed_engine::scheduler::SchedulerStats;
    use tokenspeed_engine::{KvArrival, KvTransferStats};

    #[test]
    fn arrived_transfers_show_their_time_bytes_and_count() {
        let m = Metrics::new("m", 64);
        let arrival = |room, transfer_us| KvArrival {
            room,
            bytes: 3 << 20,
            transfer_us,
        };
        m.observe_kv_arrivals(&[arrival(1, 2_000), arrival(2, 500_000)]);
        let kv_transfer = KvTransferStats {
            arrived_requests: 2,
            arrived_bytes: 6 << 20,
            arrived_us: 502_000,
            ..Default::default()
        };
        m.observe_pool(&SchedulerStats {
            kv_transfer,
            ..Default::default()
        });
        let text = m.render();
        let label = "{model_name=\"m\"}";
        for line in [
            format!("tokenspeed:kv_transfer_seconds_count{label} 2"),
            format!("tokenspeed:kv_transfer_seconds_sum{label} 0.502"),
            "tokenspeed:kv_transfer_seconds_bucket{model_name=\"m\",le=\"0.0025\"} 1".into(),
            format!("tokenspeed:kv_transfer_arrived_requests_total{label} 2"),
            format!("tokenspeed:kv_transfer_arrived_bytes_total{label} 6291456"),
        ] {
            assert!(text.contains(&line), "{line} in\n{text}");
        }
    }
}
