//! Publishing the radix cache's KV events (`--kv-events-config`) to cache-aware routers
//! (llm-d, NVIDIA Dynamo, SGLang's router) in the layout vLLM and SGLang publish, so their
//! consumers decode it unchanged.
//!
//! Wire: a ZMQ PUB socket sends multipart messages `[topic, seq, payload]`: `seq` an 8-byte
//! big-endian counter from 0 (a gap means the subscriber missed batches), `payload` msgpack of
//! an `EventBatch` as msgspec encodes its array-like tagged structs:
//! `[ts, [event, ...], data_parallel_rank]` with each event one of
//! `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
//! `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]` (medium: "GPU").
//! With a replay endpoint, a ROUTER socket answers a request `[start_seq]` (8 bytes,
//! big-endian) with every buffered `[seq, payload]` from there, then `[-1, ""]`.
//!
//! The engine thread only hands batches over (`KvEventSink::publish`, never blocking: a full
//! queue drops the batch and the seq gap tells the subscriber); the sockets live on the
//! publisher's own thread and runtime, so no I/O runs on the scheduler's thread.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokenspeed_engine::KvEvent;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// `--kv-events-config` as the launcher resolved it (python/tokenspeed/config/kv_events.py:
/// vLLM's keys, every one present; None when the publisher is "null").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    pub publisher: String,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub buffer_steps: usize,
    pub hwm: usize,
    pub max_queue_size: usize,
    pub topic: String,
}

/// The medium every event names: the device tier (radix_events.rs).
const MEDIUM: &str = "GPU";

/// The engine thread's end: batches go to the publisher thread.
#[derive(Debug, Clone)]
pub struct KvEventSink {
    tx: mpsc::Sender<Vec<KvEvent>>,
}

impl KvEventSink {
    /// Queues one step's events; drops them (with a warning) when the queue is full.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send(events) {
            tracing::warn!("KV events queue full (max_queue_size): a batch was dropped");
        }
    }
}

/// `endpoint` for data-parallel rank `rank`: the port plus the rank, as vLLM and SGLang do.
pub fn endpoint_for_rank(endpoint: &str, rank: u32) -> Result<String, String> {
    let (base, port) = endpoint
        .rsplit_once(':')
        .filter(|_| endpoint.starts_with("tcp://"))
        .ok_or_else(|| {
            format!("--kv-events-config: endpoint {endpoint:?} is not tcp://host:port")
        })?;
    let port: u32 = port
        .parse()
        .map_err(|_| format!("--kv-events-config: endpoint {endpoint:?} has no port number"))?;
    let port = u16::try_from(port + rank)
        .map_err(|_| format!("--kv-events-config: port {port} + rank {rank} is past 65535"))?;
    Ok(format!("{base}:{port}"))
}

/// Binds (host `*` or `::`) or connects (any other host) the sockets of rank `rank` on a
/// thread of their own and returns the sink once they are ready (or why they are not).
pub fn start(config: &KvEventsConfig, rank: u32) -> Result<KvEventSink, String> {
    let endpoint = endpoint_for_rank(&config.endpoint, rank)?;
    let replay = match &config.replay_endpoint {
        Some(e) => Some(endpoint_for_rank(e, rank)?),
        None => None,
    };
    let (tx, rx) = mpsc::channel(config.max_queue_size.max(1));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let publisher = Publisher {
        topic: config.topic.clone().into_bytes(),
        rank,
        buffer: Arc::new(Mutex::new(VecDeque::new())),
        buffer_steps: config.buffer_steps,
    };
    std::thread::Builder::new()
        .name(format!("tokenspeed-kv-events-{rank}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("KV events runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(publisher.run(endpoint, replay, rx, ready_tx));
        })
        .map_err(|e| format!("spawning the KV events thread: {e}"))?;
    ready_rx
        .recv()
        .map_err(|_| "the KV events thread died at start".to_string())??;
    Ok(KvEventSink { tx })
}

/// Published batches kept for replay: (seq, payload).
type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

struct Publisher {
    topic: Vec<u8>,
    rank: u32,
    buffer: ReplayBuffer,
    buffer_steps: usize,
}

impl Publisher {
    async fn run(
        self,
        endpoint: String,
        replay: Option<String>,
        mut rx: mpsc::Receiver<Vec<KvEvent>>,
        ready: std::sync::mpsc::Sender<Result<(), String>>,
    ) {
        let mut socket = zeromq::PubSocket::new();
        if let Err(e) = attach(&mut socket, &endpoint).await {
            let _ = ready.send(Err(e));
            return;
        }
        if let Some(replay) = replay {
            let mut router = zeromq::RouterSocket::new();
            if let Err(e) = router.bind(&bind_address(&replay)).await {
                let _ = ready.send(Err(format!("--kv-events-config: replay {replay}: {e}")));
                return;
            }
            tokio::spawn(serve_replay(router, self.buffer.clone()));
        }
        tracing::info!(
            "publishing KV events on {endpoint} (data parallel rank {})",
            self.rank
        );
        let _ = ready.send(Ok(()));
        let mut seq: u64 = 0;
        while let Some(events) = rx.recv().await {
            let payload = encode_batch(&events, now_secs(), self.rank);
            let mut message = ZmqMessage::from(self.topic.clone());
            message.push_back(seq.to_be_bytes().to_vec().into());
            message.push_back(payload.clone().into());
            if let Err(e) = socket.send(message).await {
                tracing::warn!("KV events: publishing batch {seq} failed: {e}");
            }
            if self.buffer_steps > 0 {
                if let Ok(mut buffer) = self.buffer.lock() {
                    if buffer.len() >= self.buffer_steps {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload));
                }
            }
            seq += 1;
        }
    }
}

/// zeromq's TCP transport binds an IP: `*` (libzmq's any-interface) becomes 0.0.0.0.
fn bind_address(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// vLLM's rule: bind a wildcard host, connect to any other (a broker, say).
async fn attach(socket: &mut zeromq::PubSocket, endpoint: &str) -> Result<(), String> {
    let wildcard = endpoint.contains('*') || endpoint.contains("::");
    let done = if wildcard {
        socket.bind(&bind_address(endpoint)).await.map(|_| ())
    } else {
        socket.connect(endpoint).await
    };
    done.map_err(|e| format!("--kv-events-config: endpoint {endpoint}: {e}"))
}

/// Answers replay requests `[identity, "", start_seq]` until the socket fails.
async fn serve_replay(mut router: zeromq::RouterSocket, buffer: ReplayBuffer) {
    while let Ok(request) = router.recv().await {
        let frames: Vec<Vec<u8>> = request.into_vec().into_iter().map(|b| b.to_vec()).collect();
        let [identity, _, start] = frames.as_slice() else {
            tracing::warn!(
                "KV events: a replay request of {} frames ignored",
                frames.len()
            );
            continue;
        };
        let start = <[u8; 8]>::try_from(start.as_slice()).map_or(u64::MAX, u64::from_be_bytes);
        let batches: Vec<(u64, Vec<u8>)> = match buffer.lock() {
            Ok(b) => b.iter().filter(|(s, _)| *s >= start).cloned().collect(),
            Err(_) => Vec::new(),
        };
        let end = ((-1i64).to_be_bytes().to_vec(), Vec::new());
        for (seq, payload) in batches
            .into_iter()
            .map(|(s, p)| (s.to_be_bytes().to_vec(), p))
            .chain(std::iter::once(end))
        {
            let mut reply = ZmqMessage::from(identity.clone());
            for frame in [Vec::new(), seq, payload] {
                reply.push_back(frame.into());
            }
            if router.send(reply).await.is_err() {
                break;
            }
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The msgpack of one `EventBatch` (the module doc gives the layout).
pub fn encode_batch(events: &[KvEvent], ts: f64, rank: u32) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail; an error would only leave a truncated payload.
    let _ = write_batch(&mut out, events, ts, rank);
    out
}

type Written = Result<(), rmp::encode::ValueWriteError>;

fn write_batch(out: &mut Vec<u8>, events: &[KvEvent], ts: f64, rank: u32) -> Written {
    use rmp::encode::{write_array_len, write_f64, write_uint};
    write_array_len(out, 3)?;
    write_f64(out, ts)?;
    write_array_len(out, events.len() as u32)?;
    for event in events {
        write_event(out, event)?;
    }
    write_uint(out, u64::from(rank))?;
    Ok(())
}

fn write_event(out: &mut Vec<u8>, event: &KvEvent) -> Written {
    use rmp::encode::{write_array_len, write_nil, write_str, write_uint, ValueWriteError};
    match event {
        KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
        } => {
            write_array_len(out, 7)?;
            write_str(out, "BlockStored")?;
            write_uints(out, block_hashes.iter().copied())?;
            match parent_block_hash {
                Some(h) => write_uint(out, *h).map(|_| ())?,
                None => write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?,
            }
            write_uints(out, token_ids.iter().map(|&t| u64::from(t)))?;
            write_uint(out, *block_size as u64)?;
            match lora_id {
                Some(id) => write_uint(out, u64::from(*id)).map(|_| ())?,
                None => write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?,
            }
            write_str(out, MEDIUM)?;
        }
        KvEvent::Removed { block_hashes } => {
            write_array_len(out, 3)?;
            write_str(out, "BlockRemoved")?;
            write_uints(out, block_hashes.iter().copied())?;
            write_str(out, MEDIUM)?;
        }
        KvEvent::AllCleared => {
            write_array_len(out, 1)?;
            write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn write_uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) -> Written {
    rmp::encode::write_array_len(out, values.len() as u32)?;
    for v in values {
        rmp::encode::write_uint(out, v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_offset_the_port() {
        assert_eq!(
            endpoint_for_rank("tcp://*:5557", 0).unwrap(),
            "tcp://*:5557"
        );
        assert_eq!(
            endpoint_for_rank("tcp://*:5557", 2).unwrap(),
            "tcp://*:5559"
        );
        assert!(endpoint_for_rank("ipc:///tmp/kv", 1).is_err());
        assert!(endpoint_for_rank("tcp://*:65535", 1).is_err());
    }

    #[test]
    fn a_batch_is_msgspecs_array_like_tagged_layout() {
        let events = [
            KvEvent::Stored {
                block_hashes: vec![1, 2],
                parent_block_hash: None,
                token_ids: vec![5, 6, 7, 8],
                block_size: 2,
                lora_id: Some(3),
            },
            KvEvent::Removed {
                block_hashes: vec![1],
            },
            KvEvent::AllCleared,
        ];
        let bytes = encode_batch(&events, 1.5, 4);
        let mut expected = vec![0x93, 0xcb];
        expected.extend(1.5f64.to_be_bytes());
        expected.push(0x93);
        expected.extend([0x97, 0xab]);
        expected.extend(b"BlockStored");
        expected.extend([0x92, 1, 2, 0xc0, 0x94, 5, 6, 7, 8, 2, 3, 0xa3]);
        expected.extend(b"GPU");
        expected.extend([0x93, 0xac]);
        expected.extend(b"BlockRemoved");
        expected.extend([0x91, 1, 0xa3]);
        expected.extend(b"GPU");
        expected.extend([0x91, 0xb0]);
        expected.extend(b"AllBlocksCleared");
        expected.push(4);
        assert_eq!(bytes, expected);
    }
}
