//! Codec tests: plan/result round trips (proptest), layout alignment and size errors.

use proptest::prelude::*;
use tokenspeed_engine::plan::{NewRequestPlan, PageTableUpdate, SampledToken, ScheduledRequest};
use tokenspeed_engine::{Plan, SamplingParams, StepResult};
use tokenspeed_ipc::codec::{
    decode_plan, decode_result, encode_plan, encode_result, encode_result_bytes, plan_encoded_len,
    plan_layout_of, result_encoded_len,
};
use tokenspeed_ipc::{IpcError, ResultBytes};

/// Keys of `python/tokenspeed/plan.py::StepPlan` besides `step_id`.
const WORKER_KEYS: [&str; 20] = [
    "finished_slots",
    "new_slots",
    "new_temperature",
    "new_top_p",
    "new_top_k",
    "new_min_p",
    "new_repetition_penalty",
    "new_frequency_penalty",
    "new_presence_penalty",
    "new_seed",
    "new_top_logprobs",
    "pt_slots",
    "pt_first",
    "pt_count",
    "pt_pages",
    "slots",
    "num_tokens",
    "start_pos",
    "sample",
    "input_ids",
];

fn f() -> impl Strategy<Value = f32> {
    -1.0e6f32..1.0e6
}

fn sampling() -> impl Strategy<Value = SamplingParams> {
    (
        (f(), f(), any::<i32>(), f()),
        (f(), f(), f()),
        proptest::option::of(0u64..(1 << 63)),
        any::<u32>(),
    )
        .prop_map(|((t, p, k, m), (r, fr, pr), seed, lp)| SamplingParams {
            temperature: t,
            top_p: p,
            top_k: k,
            min_p: m,
            repetition_penalty: r,
            frequency_penalty: fr,
            presence_penalty: pr,
            seed,
            top_logprobs: lp,
        })
}

fn plan() -> impl Strategy<Value = Plan> {
    let new =
        (any::<u32>(), sampling()).prop_map(|(slot, sampling)| NewRequestPlan { slot, sampling });
    let pt = (
        any::<u32>(),
        any::<u32>(),
        prop::collection::vec(any::<u32>(), 0..9),
    )
        .prop_map(|(slot, first_index, pages)| PageTableUpdate {
            slot,
            first_index,
            pages,
        });
    let sched = (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(
            |(slot, num_tokens, start_pos, cached_len, sample)| ScheduledRequest {
                slot,
                num_tokens,
                start_pos,
                cached_len,
                sample,
            },
        );
    (
        any::<u64>(),
        prop::collection::vec(any::<u32>(), 0..7),
        prop::collection::vec(new, 0..5),
        prop::collection::vec(pt, 0..5),
        prop::collection::vec(sched, 0..9),
        prop::collection::vec(any::<u32>(), 0..40),
    )
        .prop_map(
            |(step_id, finished_slots, new_requests, page_table_updates, scheduled, input_ids)| {
                Plan {
                    step_id,
                    finished_slots,
                    new_requests,
                    page_table_updates,
                    scheduled,
                    input_ids,
                }
            },
        )
}

fn result() -> impl Strategy<Value = StepResult> {
    let top = prop::collection::vec((0u32..u32::MAX, f()), 0..6);
    let entry =
        (any::<u32>(), any::<u32>(), f(), top).prop_map(|(slot, token, logprob, top_logprobs)| {
            SampledToken {
                slot,
                token,
                logprob,
                top_logprobs,
            }
        });
    (any::<u64>(), prop::collection::vec(entry, 0..12))
        .prop_map(|(step_id, sampled)| StepResult { step_id, sampled })
}

proptest! {
    #[test]
    fn plan_round_trip(p in plan()) {
        let mut buf = vec![0u8; plan_encoded_len(&p)];
        let n = encode_plan(&p, &mut buf).unwrap();
        prop_assert_eq!(n, buf.len());
        prop_assert_eq!(decode_plan(&buf).unwrap(), p.clone());
        let lay = plan_layout_of(&buf).unwrap();
        prop_assert_eq!(lay.step_id, p.step_id);
        for a in &lay.arrays {
            prop_assert_eq!(a.offset % 8, 0);
            prop_assert!(a.offset + a.count * a.dtype.size() <= buf.len());
        }
        prop_assert_eq!(lay.array("input_ids").unwrap().count, p.input_ids.len());
    }

    #[test]
    fn result_round_trip(r in result()) {
        let mut buf = vec![0u8; result_encoded_len(&r)];
        let n = encode_result(&r, &mut buf).unwrap();
        prop_assert_eq!(n, buf.len());
        prop_assert_eq!(decode_result(&buf).unwrap(), r);
    }
}

#[test]
fn worker_visible_arrays_match_plan_py() {
    let mut buf = vec![0u8; 256];
    encode_plan(&Plan::default(), &mut buf).unwrap();
    let lay = plan_layout_of(&buf).unwrap();
    let visible: Vec<_> = lay
        .arrays
        .iter()
        .filter(|a| a.worker_visible)
        .map(|a| a.name)
        .collect();
    assert_eq!(visible, WORKER_KEYS);
    let dt = |n: &str| lay.array(n).unwrap().dtype.numpy();
    assert_eq!(dt("new_seed"), "<i8");
    assert_eq!(dt("new_top_k"), "<i4");
    assert_eq!(dt("sample"), "u1");
    assert_eq!(dt("new_temperature"), "<f4");
    assert_eq!(dt("input_ids"), "<u4");
}

#[test]
fn seed_none_is_minus_one() {
    let mut p = Plan {
        step_id: 3,
        ..Default::default()
    };
    let seeds = [None, Some(7), Some(u64::MAX)];
    for (i, s) in seeds.iter().enumerate() {
        let sampling = SamplingParams {
            seed: *s,
            ..Default::default()
        };
        p.new_requests.push(NewRequestPlan {
            slot: i as u32,
            sampling,
        });
    }
    let mut buf = vec![0u8; plan_encoded_len(&p)];
    encode_plan(&p, &mut buf).unwrap();
    let lay = plan_layout_of(&buf).unwrap();
    let a = lay.array("new_seed").unwrap();
    let got: Vec<i64> = (0..3)
        .map(|i| {
            i64::from_le_bytes(
                buf[a.offset + 8 * i..a.offset + 8 * i + 8]
                    .try_into()
                    .unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [-1, 7, i64::MAX]);
}

#[test]
fn too_small_buffer_is_an_error() {
    let p = Plan {
        input_ids: vec![1; 100],
        ..Default::default()
    };
    let mut buf = vec![0u8; 64];
    match encode_plan(&p, &mut buf) {
        Err(IpcError::TooLarge { need, cap: 64 }) => assert!(need > 400),
        other => panic!("{other:?}"),
    }
}

#[test]
fn result_bytes_checks_lengths_and_matches_struct_encoding() {
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let lf = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (slots, tokens, lps) = (le(&[4, 9]), le(&[100, 200]), lf(&[-0.5, -1.5]));
    let (ids, tlps) = (le(&[1, 2, 3, 4]), lf(&[-0.1, -0.2, -0.3, -0.4]));
    let ok = ResultBytes {
        step_id: 11,
        top_k: 2,
        slots: &slots,
        tokens: &tokens,
        logprobs: &lps,
        top_ids: &ids,
        top_logprobs: &tlps,
    };
    let mut buf = vec![0u8; ok.encoded_len().unwrap()];
    encode_result_bytes(&ok, &mut buf).unwrap();
    let r = decode_result(&buf).unwrap();
    assert_eq!(r.step_id, 11);
    assert_eq!(r.sampled[1].top_logprobs, vec![(3, -0.3), (4, -0.4)]);
    let bad = ResultBytes { top_k: 3, ..ok };
    assert!(matches!(bad.encoded_len(), Err(IpcError::BadResult(_))));
    let bad = ResultBytes {
        tokens: &tokens[..4],
        ..ok
    };
    assert!(matches!(
        encode_result_bytes(&bad, &mut buf),
        Err(IpcError::BadResult(_))
    ));
}

#[test]
fn garbage_is_rejected() {
    assert!(matches!(decode_plan(&[0u8; 64]), Err(IpcError::Corrupt(_))));
    assert!(matches!(
        decode_result(&[1u8; 10]),
        Err(IpcError::Corrupt(_))
    ));
    // A plan header claiming more data than the payload holds.
    let p = Plan {
        input_ids: vec![5; 10],
        ..Default::default()
    };
    let mut buf = vec![0u8; plan_encoded_len(&p)];
    encode_plan(&p, &mut buf).unwrap();
    assert!(matches!(
        decode_plan(&buf[..buf.len() - 8]),
        Err(IpcError::Corrupt(_))
    ));
}
