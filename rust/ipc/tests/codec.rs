//! Codec tests: every plan section and result event round-trips (proptest), the layout is
//! aligned and named after the schema, raw arrays encode like rows, bad input is rejected.

use proptest::prelude::*;
use tokenspeed_engine::plan::{
    CopyOp, FinishedSlot, PageTableUpdate, RequestEvent, ScheduledRequest,
};
use tokenspeed_engine::schema::Message;
use tokenspeed_engine::{
    GrammarRow, KvArrival, KvPairDown, LoraPin, OpOutcome, Plan, SamplingParams, StepLimits,
    StepResult, StepTiming, TokenMask, WorkerOp,
};
use tokenspeed_ipc::codec::{decode, encode, encode_arrays, layout_of, DType};
use tokenspeed_ipc::IpcError;

fn f() -> impl Strategy<Value = f32> {
    -1.0e6f32..1.0e6
}

fn ids(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(any::<u32>(), 0..max)
}

fn sampling() -> impl Strategy<Value = SamplingParams> {
    (
        (any::<u32>(), f(), f(), any::<i32>(), f()),
        (f(), f(), f()),
        (any::<i64>(), any::<u32>(), any::<u32>(), ids(5)),
        (ids(4), prop::collection::vec(f(), 0..4), any::<bool>()),
        (any::<bool>(), any::<u32>()),
    )
        .prop_map(
            |(
                (slot, t, p, k, m),
                (r, fr, pr),
                (seed, lp, min_tokens, stop_ids),
                (bias_ids, bias, prompt_logprobs),
                (pooling, segment_b),
            )| SamplingParams {
                slot,
                temperature: t,
                top_p: p,
                top_k: k,
                min_p: m,
                repetition_penalty: r,
                frequency_penalty: fr,
                presence_penalty: pr,
                seed,
                top_logprobs: lp,
                min_tokens,
                prompt_logprobs,
                pooling,
                segment_b,
                stop_ids,
                logit_bias_ids: bias_ids,
                logit_bias_values: bias,
                lora_id: slot % 3,
                lora_path: vec![b'a'; (slot % 5) as usize],
            },
        )
}

fn plan() -> impl Strategy<Value = Plan> {
    let pt =
        (any::<u32>(), any::<u32>(), ids(9)).prop_map(|(slot, first, pages)| PageTableUpdate {
            slot,
            first,
            pool: (slot % 2) as u8,
            pages,
        });
    let sched = (
        any::<u32>(),
        any::<u32>(),
        any::<bool>(),
        any::<u32>(),
        any::<bool>(),
        ids(12),
    )
        .prop_map(
            |(slot, start_pos, sample, num_draft_tokens, pause_drafts, tokens)| ScheduledRequest {
                slot,
                start_pos,
                sample,
                num_draft_tokens,
                pause_drafts,
                tokens,
            },
        );
    let copy = (any::<u32>(), any::<u32>()).prop_map(|(src, dst)| CopyOp {
        src,
        dst,
        kind: 0,
        key: 0,
    });
    let mask = (any::<u32>(), ids(6)).prop_map(|(slot, allowed)| TokenMask { slot, allowed });
    let op = (any::<u8>(), prop::collection::vec(any::<u8>(), 0..40))
        .prop_map(|(kind, args)| WorkerOp { kind, args });
    let grammar = (
        any::<u32>(),
        any::<u8>(),
        any::<i64>(),
        prop::collection::vec(any::<u8>(), 0..40),
        ids(3),
        ids(7),
    )
        .prop_map(
            |(slot, kind, starts_after, text, stop_ids, generated)| GrammarRow {
                slot,
                kind,
                starts_after,
                text,
                stop_ids,
                generated,
            },
        );
    (
        any::<u64>(),
        prop::collection::vec(any::<u32>().prop_map(|slot| FinishedSlot { slot }), 0..7),
        prop::collection::vec(sampling(), 0..5),
        prop::collection::vec(pt, 0..5),
        prop::collection::vec(copy, 0..4),
        prop::collection::vec(sched, 0..9),
        prop::collection::vec(mask, 0..3),
        prop::collection::vec(grammar, 0..3),
        prop::collection::vec(op, 0..2),
        prop::collection::vec(any::<u32>().prop_map(|adapter| LoraPin { adapter }), 0..4),
    )
        .prop_map(
            |(
                step_id,
                finished,
                new_requests,
                page_tables,
                copies,
                scheduled,
                masks,
                grammars,
                ops,
                lora_pins,
            )| Plan {
                step_id,
                finished,
                new_requests,
                page_tables,
                copies,
                scheduled,
                masks,
                grammars,
                ops,
                lora_pins,
            },
        )
}

fn event() -> impl Strategy<Value = RequestEvent> {
    let floats = |n: usize| prop::collection::vec(f(), 0..n);
    (
        (any::<u32>(), any::<u32>(), any::<u32>()),
        (ids(4), floats(4), ids(8), floats(8)),
        (floats(6), ids(6), floats(6), ids(6), floats(5)),
        ids(4),
    )
        .prop_map(
            |(
                (slot, error, top_k),
                (tokens, logprobs, top_ids, top_logprobs),
                (prompt_logprobs, prompt_top_ids, prompt_top_logprobs, prompt_ranks, pooled),
                draft_tokens,
            )| RequestEvent {
                slot,
                error,
                top_k,
                tokens,
                logprobs,
                top_ids,
                top_logprobs,
                prompt_logprobs,
                prompt_top_ids,
                prompt_top_logprobs,
                prompt_ranks,
                pooled,
                draft_tokens,
            },
        )
}

fn result() -> impl Strategy<Value = StepResult> {
    (
        any::<u64>(),
        prop::collection::vec(event(), 0..12),
        prop::option::of((any::<u32>(), any::<u32>())),
        prop::option::of((any::<bool>(), prop::collection::vec(any::<u8>(), 0..40))),
        (
            prop::collection::vec((any::<i64>(), any::<i64>(), any::<u32>()), 0..4),
            prop::option::of(prop::collection::vec(any::<u8>(), 0..40)),
        ),
    )
        .prop_map(|(step_id, events, timing, op, (rooms, down))| StepResult {
            step_id,
            events,
            timing: timing
                .map(|(gpu_idle_us, gpu_busy_us)| StepTiming {
                    gpu_idle_us,
                    gpu_busy_us,
                })
                .into_iter()
                .collect(),
            op_results: op
                .map(|(ok, message)| OpOutcome { ok, message })
                .into_iter()
                .collect(),
            kv_arrived: rooms
                .into_iter()
                .map(|(room, bytes, transfer_us)| KvArrival {
                    room,
                    bytes,
                    transfer_us,
                })
                .collect(),
            kv_down: down
                .map(|message| KvPairDown { message })
                .into_iter()
                .collect(),
        })
}

proptest! {
    #[test]
    fn plan_round_trip(p in plan()) {
        let mut buf = vec![0u8; p.encoded_len()];
        let n = encode(&p, &mut buf).unwrap();
        prop_assert_eq!(n, buf.len());
        prop_assert_eq!(decode::<Plan>(&buf).unwrap(), p.clone());
        let lay = layout_of::<Plan>(&buf).unwrap();
        prop_assert_eq!(lay.step_id, p.step_id);
        for a in &lay.arrays {
            prop_assert_eq!(a.offset % 8, 0);
            prop_assert!(a.offset + a.count * a.dtype.size() <= buf.len());
        }
        prop_assert_eq!(lay.array("sched_tokens").unwrap().count, p.num_tokens());
    }

    #[test]
    fn result_round_trip(r in result()) {
        let mut buf = vec![0u8; r.encoded_len()];
        let n = encode(&r, &mut buf).unwrap();
        prop_assert_eq!(n, buf.len());
        prop_assert_eq!(decode::<StepResult>(&buf).unwrap(), r);
    }

    /// Raw arrays by name (what Python sends) encode exactly like the rows they hold.
    #[test]
    fn arrays_encode_like_rows(r in result()) {
        let mut rows = vec![0u8; r.encoded_len()];
        encode(&r, &mut rows).unwrap();
        let lay = layout_of::<StepResult>(&rows).unwrap();
        let arrays: Vec<(String, Vec<u8>)> = lay
            .arrays
            .iter()
            .map(|a| (a.name.clone(), rows[a.offset..a.offset + a.count * a.dtype.size()].to_vec()))
            .collect();
        let get = |n: &str| arrays.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_slice());
        let mut raw = vec![0u8; rows.len()];
        let n = encode_arrays::<StepResult>(r.step_id, get, &mut raw).unwrap();
        prop_assert_eq!(&raw[..n], &rows[..]);
    }
}

#[test]
fn array_names_follow_the_declaration() {
    let names: Vec<(String, DType)> = Plan::array_names();
    let find = |n: &str| names.iter().find(|(k, _)| k == n).map(|(_, d)| d.numpy());
    assert_eq!(find("finished_slot"), Some("<u4"));
    assert_eq!(find("new_temperature"), Some("<f4"));
    assert_eq!(find("new_top_k"), Some("<i4"));
    assert_eq!(find("new_seed"), Some("<i8"));
    assert_eq!(find("new_stop_ids_len"), Some("<u4"));
    assert_eq!(find("pt_pages"), Some("<u4"));
    assert_eq!(find("sched_sample"), Some("u1"));
    assert_eq!(find("sched_tokens"), Some("<u4"));
    assert_eq!(find("copy_src"), Some("<u4"));
    let names = StepResult::array_names();
    assert!(names
        .iter()
        .any(|(n, d)| n == "event_tokens" && *d == DType::U32));
    assert!(names
        .iter()
        .any(|(n, d)| n == "event_logprobs" && *d == DType::F32));
    assert!(names
        .iter()
        .any(|(n, d)| n == "timing_gpu_idle_us" && *d == DType::U32));
}

#[test]
fn a_result_without_timing_reports_no_gpu_idle_and_one_with_it_is_within_the_slot_bound() {
    let l = StepLimits {
        max_running: 2,
        max_step_tokens: 8,
        max_pages_per_request: 4,
        mask_words: 0,
        worker_grammars: false,
        pooled_dim: 0,
        host_copies: false,
        storage_copies: false,
        kv_transfer: false,
        top_logprobs: 20,
        max_drafts: 0,
    };
    let mut r = StepResult {
        step_id: 3,
        events: vec![RequestEvent::default(); 2],
        ..Default::default()
    };
    assert_eq!(r.gpu_idle_us(), 0);
    assert_eq!(r.gpu_busy(), None);
    r.timing = vec![StepTiming {
        gpu_idle_us: u32::MAX,
        gpu_busy_us: 0,
    }];
    assert_eq!(r.gpu_idle_us(), u64::from(u32::MAX));
    assert_eq!(r.gpu_busy(), None, "0: not measured");
    assert!(r.encoded_len() <= StepResult::max_encoded_len(&l));
    let mut buf = vec![0u8; StepResult::max_encoded_len(&l)];
    encode(&r, &mut buf).unwrap();
    assert_eq!(
        decode::<StepResult>(&buf).unwrap().gpu_idle_us(),
        u64::from(u32::MAX)
    );
    r.timing[0].gpu_busy_us = 25_000;
    assert_eq!(r.gpu_busy(), Some(std::time::Duration::from_millis(25)));
}

#[test]
fn missing_arrays_are_zeros_and_mismatched_ones_are_refused() {
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let slot = le(&[4, 9]);
    let (lens, toks) = (le(&[1, 2]), le(&[100, 200, 201]));
    let lps: Vec<u8> = [-0.5f32, -1.0, -1.5]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let arrays = [
        ("event_slot", &slot),
        ("event_tokens_len", &lens),
        ("event_tokens", &toks),
        ("event_logprobs_len", &lens),
        ("event_logprobs", &lps),
    ];
    let get = |n: &str| {
        arrays
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.as_slice())
    };
    let mut buf = vec![0u8; 4096];
    encode_arrays::<StepResult>(11, get, &mut buf).unwrap();
    let r = decode::<StepResult>(&buf).unwrap();
    assert_eq!(r.step_id, 11);
    assert_eq!(r.events[1].tokens, vec![200, 201]);
    assert_eq!(r.events[1].logprobs, vec![-1.0, -1.5]);
    assert_eq!((r.events[0].error, r.events[0].top_k), (0, 0));
    let short = le(&[4]);
    let bad = |n: &str| {
        if n == "event_slot" {
            Some(short.as_slice())
        } else {
            get(n)
        }
    };
    assert!(matches!(
        encode_arrays::<StepResult>(1, bad, &mut buf),
        Err(IpcError::BadResult(_))
    ));
    let wrong_sum = le(&[1, 1]);
    let bad = |n: &str| {
        if n == "event_tokens_len" {
            Some(wrong_sum.as_slice())
        } else {
            get(n)
        }
    };
    assert!(matches!(
        encode_arrays::<StepResult>(1, bad, &mut buf),
        Err(IpcError::BadResult(_))
    ));
}

#[test]
fn too_small_buffer_is_an_error() {
    let p = Plan {
        scheduled: vec![ScheduledRequest {
            tokens: vec![1; 100],
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut buf = vec![0u8; 64];
    match encode(&p, &mut buf) {
        Err(IpcError::TooLarge { need, cap: 64 }) => assert!(need > 400),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_slot_bound_holds_the_largest_step() {
    let l = StepLimits {
        max_running: 4,
        max_step_tokens: 32,
        max_pages_per_request: 8,
        mask_words: 5,
        worker_grammars: true,
        pooled_dim: 0,
        host_copies: false,
        storage_copies: false,
        kv_transfer: false,
        top_logprobs: 20,
        max_drafts: 0,
    };
    let full = Plan {
        finished: vec![FinishedSlot::default(); 4],
        new_requests: vec![
            SamplingParams {
                stop_ids: vec![1; 8],
                logit_bias_ids: vec![1; tokenspeed_engine::MAX_LOGIT_BIAS],
                logit_bias_values: vec![1.0; tokenspeed_engine::MAX_LOGIT_BIAS],
                lora_path: vec![b'/'; tokenspeed_engine::MAX_LORA_PATH],
                ..Default::default()
            };
            4
        ],
        page_tables: vec![
            PageTableUpdate {
                pages: vec![1; 8],
                ..Default::default()
            };
            8
        ],
        copies: vec![CopyOp::default(); 32],
        scheduled: vec![
            ScheduledRequest {
                tokens: vec![1; 9],
                ..Default::default()
            };
            4
        ],
        masks: vec![
            TokenMask {
                allowed: vec![u32::MAX; 5],
                ..Default::default()
            };
            4
        ],
        grammars: (0..4)
            .map(|i| GrammarRow {
                text: vec![b'x'; tokenspeed_engine::MAX_GRAMMAR_TEXT],
                stop_ids: vec![1; tokenspeed_engine::MAX_GRAMMAR_STOP_IDS],
                // The replay budget is per plan: all of it on one row.
                generated: vec![
                    1;
                    if i == 0 {
                        tokenspeed_engine::MAX_GRAMMAR_REPLAY
                    } else {
                        0
                    }
                ],
                ..Default::default()
            })
            .collect(),
        // An op travels alone, but the bound adds every section's.
        ops: vec![WorkerOp {
            args: vec![b'x'; tokenspeed_engine::MAX_OP_TEXT],
            ..Default::default()
        }],
        lora_pins: vec![LoraPin::default(); tokenspeed_engine::MAX_LORA_PINS],
        ..Default::default()
    };
    assert!(full.encoded_len() <= Plan::max_encoded_len(&l));
    let one_more = Plan {
        scheduled: vec![
            ScheduledRequest {
                tokens: vec![1; 10],
                ..Default::default()
            };
            4
        ],
        ..full
    };
    assert!(one_more.encoded_len() > Plan::max_encoded_len(&l));
}

#[test]
fn the_result_bound_follows_the_top_logprobs_width() {
    // `--max-logprobs` sets the width: every token of a full step with that many top
    // logprobs fits, one column more does not, and the default width costs what it did.
    let limits = |k: usize| StepLimits {
        max_running: 2,
        max_step_tokens: 6,
        max_pages_per_request: 4,
        mask_words: 0,
        worker_grammars: false,
        pooled_dim: 0,
        host_copies: false,
        storage_copies: false,
        kv_transfer: false,
        top_logprobs: k,
        max_drafts: 0,
    };
    let full = |k: usize| StepResult {
        events: (0..2)
            .map(|slot| RequestEvent {
                slot,
                top_k: k as u32,
                // Per slot: its decode token and drafts (4 of the 6 step tokens), and the
                // prompt tokens it scored (the whole step's, 6, on one slot's event).
                tokens: vec![1; 4],
                logprobs: vec![-1.0; 4],
                top_ids: vec![1; 4 * k],
                top_logprobs: vec![-1.0; 4 * k],
                prompt_logprobs: vec![-1.0; 3],
                prompt_top_ids: vec![1; 3 * k],
                prompt_top_logprobs: vec![-1.0; 3 * k],
                prompt_ranks: vec![1; 3],
                ..Default::default()
            })
            .collect(),
        timing: vec![StepTiming::default()],
        op_results: vec![OpOutcome {
            message: vec![b'x'; tokenspeed_engine::MAX_OP_TEXT],
            ..Default::default()
        }],
        ..Default::default()
    };
    for k in [0, 20, 49152] {
        assert!(
            full(k).encoded_len() <= StepResult::max_encoded_len(&limits(k)),
            "{k}"
        );
        assert!(
            full(k + 1).encoded_len() > StepResult::max_encoded_len(&limits(k)),
            "{k}"
        );
    }
    let wide = StepResult::max_encoded_len(&limits(49152));
    assert!(wide > 100 * StepResult::max_encoded_len(&limits(20)));
}

#[test]
fn a_pd_results_transfer_reports_fit_the_bound_and_arrive_by_name() {
    // A decode worker reports up to one arrival per slot, and the pair's failure (one row).
    let limits = StepLimits {
        max_running: 3,
        max_step_tokens: 6,
        max_pages_per_request: 4,
        mask_words: 0,
        worker_grammars: false,
        pooled_dim: 0,
        host_copies: false,
        storage_copies: false,
        kv_transfer: true,
        top_logprobs: 0,
        max_drafts: 0,
    };
    let full = StepResult {
        kv_arrived: (0..3)
            .map(|room| KvArrival {
                room: room << 40,
                bytes: i64::MAX,
                transfer_us: u32::MAX,
            })
            .collect(),
        kv_down: vec![KvPairDown {
            message: vec![b'x'; tokenspeed_engine::MAX_OP_TEXT],
        }],
        ..Default::default()
    };
    assert!(full.encoded_len() <= StepResult::max_encoded_len(&limits));
    let plain = StepLimits {
        kv_transfer: false,
        ..limits
    };
    let room_for_them = 3 * (8 + 8 + 4) + tokenspeed_engine::MAX_OP_TEXT;
    assert!(
        StepResult::max_encoded_len(&limits) - StepResult::max_encoded_len(&plain) >= room_for_them,
        "a PD server's slot has room for them besides the rest"
    );
    // What the Python worker sends: the arrays by name.
    let rooms = le_i64(&[7, 1 << 62]);
    let bytes = le_i64(&[1 << 33, 4096]);
    let micros: Vec<u8> = [1500u32, 7].iter().flat_map(|x| x.to_le_bytes()).collect();
    let (why_len, why) = (4u32.to_le_bytes().to_vec(), b"gone".to_vec());
    let arrays: Vec<(&str, &[u8])> = vec![
        ("kv_arrived_room", &rooms),
        ("kv_arrived_bytes", &bytes),
        ("kv_arrived_transfer_us", &micros),
        ("kv_down_message_len", &why_len),
        ("kv_down_message", &why),
    ];
    let get = |n: &str| arrays.iter().find(|(k, _)| *k == n).map(|(_, v)| *v);
    let mut buf = vec![0u8; 4096];
    encode_arrays::<StepResult>(3, get, &mut buf).unwrap();
    let r = decode::<StepResult>(&buf).unwrap();
    let got: Vec<_> = r
        .kv_arrived
        .iter()
        .map(|a| (a.room, a.bytes, a.transfer_us))
        .collect();
    assert_eq!(got, vec![(7, 1 << 33, 1500), (1 << 62, 4096, 7)]);
    assert_eq!(r.kv_down[0].message, b"gone".to_vec());
    assert!(r.events.is_empty());
}

fn le_i64(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn garbage_is_rejected() {
    assert!(matches!(
        decode::<Plan>(&[0u8; 64]),
        Err(IpcError::Corrupt(_))
    ));
    assert!(matches!(
        decode::<StepResult>(&[1u8; 10]),
        Err(IpcError::Corrupt(_))
    ));
    let p = Plan {
        scheduled: vec![ScheduledRequest {
            tokens: vec![5; 10],
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut buf = vec![0u8; p.encoded_len()];
    encode(&p, &mut buf).unwrap();
    // A header claiming more data than the payload holds.
    assert!(matches!(
        decode::<Plan>(&buf[..buf.len() - 8]),
        Err(IpcError::Corrupt(_))
    ));
    // List lengths that do not add up to the list's array.
    let lay = layout_of::<Plan>(&buf).unwrap();
    let lens = lay.array("sched_tokens_len").unwrap().offset;
    buf[lens..lens + 4].copy_from_slice(&11u32.to_le_bytes());
    assert!(matches!(decode::<Plan>(&buf), Err(IpcError::Corrupt(_))));
}
