//! Prefill/decode disaggregation: a prefill scheduler sends the KV of a prompt's full pages
//! (bar the last token) after the step that computes it, a decode scheduler receives them into
//! fresh pages at admission and computes only the rest. The fake workers carry the pages from
//! one to the other, and their model reads every token back through the KV, so a missing,
//! misplaced or misordered page changes the tokens.

mod common;

use common::*;
use tokenspeed_engine::{copy_kind, kv_transfer_len, KvTransfer, Request};

const ROOM: u64 = 0xfeed_beef;

fn transfer(id: u64, prompt: Vec<u32>, max_new_tokens: u32, kv: KvTransfer) -> Request {
    Request {
        kv_transfer: kv,
        ..request(id, prompt, max_new_tokens)
    }
}

fn kv_ops(h: &Harness, kind: u8) -> Vec<(u64, tokenspeed_engine::CopyOp)> {
    h.plans
        .iter()
        .flat_map(|p| p.copies.iter().map(|c| (p.step_id, c.clone())))
        .filter(|(_, c)| c.kind == kind)
        .collect()
}

/// Prefill of `p` on one scheduler, decode on another: the decode server's tokens are those
/// of one server, and the prefill server's one token is the first of them.
fn pair(page_size: u32, p: &[u32], overlap: bool) -> (Harness, Harness) {
    let mut prefill = Harness::with_overlap(config(64, page_size), overlap);
    prefill.submit(transfer(1, p.to_vec(), 1, KvTransfer::Send { room: ROOM }));
    prefill.run(100);
    assert_eq!(
        prefill.tokens(1u64),
        reference(p, 1),
        "the prefill's first token"
    );
    let sent = prefill
        .worker
        .kv_sent
        .remove(&(ROOM as i64))
        .unwrap_or_default();
    let ps = page_size as usize;
    assert_eq!(
        sent.len() * ps,
        kv_transfer_len(p.len(), ps),
        "full pages before the last token"
    );

    let mut decode = Harness::with_overlap(config(64, page_size), overlap);
    if !sent.is_empty() {
        // Like the worker: a transfer of no pages is never sent, so nothing arrives.
        decode
            .worker
            .kv_inbox
            .insert(ROOM as i64, sent.into_iter().collect());
    }
    decode.submit(transfer(2, p.to_vec(), 6, KvTransfer::Recv { room: ROOM }));
    decode.run(100);
    assert_eq!(
        decode.tokens(2u64),
        reference(p, 6),
        "decoded from the received KV"
    );
    prefill.assert_no_leak();
    decode.assert_no_leak();
    (prefill, decode)
}

#[test]
fn a_pd_pair_gives_the_tokens_of_one_server() {
    for overlap in [false, true] {
        for (ps, len) in [(4, 10), (4, 13), (1, 7), (16, 40)] {
            let p = prompt(3, len);
            let (prefill, decode) = pair(ps, &p, overlap);
            let ps = ps as usize;
            let pages = kv_transfer_len(len, ps) / ps;
            // The sends ride in the plan whose forward computes the prompt's last chunk.
            let sends = kv_ops(&prefill, copy_kind::KV_SEND);
            assert_eq!(sends.len(), pages);
            let last_chunk = prefill
                .plans
                .iter()
                .find(|pl| pl.scheduled.iter().any(|r| r.sample));
            assert!(sends
                .iter()
                .all(|(step, _)| Some(*step) == last_chunk.map(|pl| pl.step_id)));
            // The receives ride in the admitting plan, whose chunk starts after them; before
            // it, the request waits for its KV outside the batch (a poll plan runs nothing).
            let recvs = kv_ops(&decode, copy_kind::KV_RECV);
            assert_eq!(recvs.len(), pages);
            let first = decode
                .plans
                .iter()
                .find(|pl| !pl.scheduled.is_empty())
                .expect("the request ran");
            assert!(recvs
                .iter()
                .all(|(step, c)| *step == first.step_id && c.key == ROOM as i64));
            assert_eq!(first.scheduled[0].start_pos as usize, pages * ps);
            assert_eq!(decode.last_output(2u64).prompt_tokens as usize, len);
            assert_eq!(
                decode.last_output(2u64).cached_tokens as usize,
                pages * ps,
                "received"
            );
            // What /metrics and /get_server_info report of it.
            let (requests, pages) = (u64::from(pages > 0), pages as u64);
            let sent = prefill.sched.stats().kv_transfer;
            assert_eq!((sent.sent_requests, sent.sent_pages), (requests, pages));
            assert_eq!((sent.received_requests, sent.received_pages), (0, 0));
            let got = decode.sched.stats().kv_transfer;
            assert_eq!(
                (got.received_requests, got.received_pages),
                (requests, pages)
            );
            assert_eq!((got.sent_requests, got.sent_pages), (0, 0));
            // The worker's measure of what arrived: one transfer, its bytes and time.
            let arrived = (got.arrived_requests, got.arrived_bytes, got.arrived_us);
            let per = |unit: usize| (pages as usize * unit) as u64;
            let want = (requests, per(KV_BYTES_PER_PAGE), per(KV_US_PER_PAGE));
            assert_eq!(arrived, want);
            assert_eq!(
                sent.arrived_requests, 0,
                "the prefill side receives nothing"
            );
        }
    }
}

#[test]
fn a_prompt_within_one_page_crosses_nothing() {
    let p = prompt(5, 4);
    let (prefill, decode) = pair(4, &p, false);
    assert!(kv_ops(&prefill, copy_kind::KV_SEND).is_empty());
    assert!(kv_ops(&decode, copy_kind::KV_RECV).is_empty());
    let none = tokenspeed_engine::KvTransferStats::default();
    assert_eq!(prefill.sched.stats().kv_transfer, none);
    assert_eq!(decode.sched.stats().kv_transfer, none);
    assert_eq!(
        decode.plans[0].scheduled[0].start_pos, 0,
        "the decode server computes it all"
    );
}

#[test]
fn without_a_transfer_no_plan_carries_one() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 20), 4));
    h.run(100);
    assert!(kv_ops(&h, copy_kind::KV_SEND).is_empty());
    assert!(kv_ops(&h, copy_kind::KV_RECV).is_empty());
}

#[test]
fn an_aborted_receive_frees_its_pages() {
    let p = prompt(7, 21);
    let mut decode = Harness::new(config(64, 4));
    let pages: Vec<Vec<Option<u32>>> = (0..5).map(|i| vec![Some(p[i]); 4]).collect();
    decode
        .worker
        .kv_inbox
        .insert(ROOM as i64, pages.into_iter().collect());
    decode.submit(transfer(1, p, 50, KvTransfer::Recv { room: ROOM }));
    decode.step();
    assert!(decode.sched.abort(1u64.into()));
    decode.run(20);
    decode.assert_no_leak();
}

#[test]
fn receivers_in_a_small_pool_take_turns() {
    // 8 pages of 4 tokens: two 13-token prompts growing to 28 tokens do not fit together; the
    // second receives its pages when it is admitted, whenever that is.
    let mut prefill = Harness::new(config(64, 4));
    let prompts: Vec<Vec<u32>> = (1..=2).map(|s| prompt(s, 13)).collect();
    for (i, p) in prompts.iter().enumerate() {
        let room = ROOM + i as u64;
        prefill.submit(transfer(
            i as u64 + 1,
            p.clone(),
            1,
            KvTransfer::Send { room },
        ));
    }
    prefill.run(100);
    let mut decode = Harness::new(config(8, 4));
    for (i, p) in prompts.iter().enumerate() {
        let room = ROOM + i as u64;
        let sent = prefill.worker.kv_sent.remove(&(room as i64)).expect("sent");
        decode
            .worker
            .kv_inbox
            .insert(room as i64, sent.into_iter().collect());
        decode.submit(Request {
            ignore_eos: true,
            ..transfer(i as u64 + 1, p.clone(), 15, KvTransfer::Recv { room })
        });
    }
    decode.run(200);
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(
            decode.tokens(i as u64 + 1),
            reference(p, 15),
            "request {}",
            i + 1
        );
    }
    assert_eq!(
        kv_ops(&decode, copy_kind::KV_RECV).len(),
        6,
        "each received once"
    );
    decode.assert_no_leak();
}

#[test]
fn a_penalized_request_is_computed_on_both_sides() {
    // The worker builds a penalty's history from the tokens it is fed: no KV crosses.
    let p = prompt(9, 21);
    let mut sampling = tokenspeed_engine::SamplingParams::greedy();
    sampling.frequency_penalty = 0.5;
    let mut prefill = Harness::new(config(64, 4));
    prefill.submit(Request {
        sampling: sampling.clone(),
        ..transfer(1, p.clone(), 1, KvTransfer::Send { room: ROOM })
    });
    prefill.run(50);
    assert!(kv_ops(&prefill, copy_kind::KV_SEND).is_empty());
    let mut decode = Harness::new(config(64, 4));
    decode.submit(Request {
        sampling,
        ..transfer(2, p.clone(), 4, KvTransfer::Recv { room: ROOM })
    });
    decode.run(50);
    assert!(kv_ops(&decode, copy_kind::KV_RECV).is_empty());
    assert_eq!(decode.tokens(2u64), reference(&p, 4));
}

/// The pages transfer `room` carries for prompt `p` (page size 4), as the prefill server sends.
fn sent_pages(p: &[u32], room: u64) -> Vec<Vec<Option<u32>>> {
    let mut prefill = Harness::new(config(64, 4));
    prefill.submit(transfer(9, p.to_vec(), 1, KvTransfer::Send { room }));
    prefill.run(50);
    prefill.worker.kv_sent.remove(&(room as i64)).expect("sent")
}

#[test]
fn a_receiver_waits_outside_the_batch_until_its_kv_arrives() {
    // SGLang's router sends to both servers at once: the decode server holds the request
    // while the prefill server computes it. Meanwhile it must hold no slot and no pages, and
    // the requests already running must keep stepping.
    let p = prompt(11, 21);
    let pages = sent_pages(&p, ROOM);
    let mut decode = Harness::new(config(64, 4));
    decode.submit(request(1, prompt(2, 6), 40));
    decode.step();
    decode.submit(transfer(2, p.clone(), 6, KvTransfer::Recv { room: ROOM }));
    for _ in 0..10 {
        assert!(decode.step(), "the running request keeps stepping");
    }
    assert_eq!(decode.tokens(1u64).len(), 11, "one token a step, no stall");
    assert!(decode.tokens(2u64).is_empty());
    assert!(kv_ops(&decode, copy_kind::KV_RECV).is_empty());
    assert!(
        decode.plans.iter().all(|pl| pl.new_requests.len() <= 1),
        "not admitted"
    );
    let stats = decode.sched.stats();
    assert_eq!((stats.running, stats.waiting), (1, 1));
    // Request 1's 17 tokens fill 5 pages at most; the receiver's 21 would need 6 more.
    assert!(
        stats.used_pages + stats.cached_pages <= 5,
        "it holds no pages"
    );
    assert_eq!(
        decode.sched.awaiting_kv().collect::<Vec<_>>(),
        vec![2u64.into()]
    );

    decode
        .worker
        .kv_inbox
        .insert(ROOM as i64, pages.into_iter().collect());
    decode.run(100);
    assert_eq!(
        decode.tokens(2u64),
        reference(&p, 6),
        "decoded from the received KV"
    );
    assert_eq!(kv_ops(&decode, copy_kind::KV_RECV).len(), 5);
    assert_eq!(decode.sched.awaiting_kv().count(), 0);
    decode.assert_no_leak();
}

#[test]
fn a_room_reported_before_its_request_is_admitted_without_waiting() {
    // Our own router sends to the decode server once the prefill is done: the KV is often
    // there (and reported) before the request is.
    let p = prompt(12, 17);
    let mut decode = Harness::new(config(64, 4));
    decode
        .worker
        .kv_inbox
        .insert(ROOM as i64, sent_pages(&p, ROOM).into_iter().collect());
    decode.submit(request(1, prompt(3, 5), 3));
    decode.run(20); // its results report the arrival
    let before = decode.plans.len();
    decode.submit(transfer(2, p.clone(), 4, KvTransfer::Recv { room: ROOM }));
    decode.run(50);
    let admitting = &decode.plans[before];
    assert_eq!(admitting.new_requests.len(), 1, "admitted by the next plan");
    assert!(admitting
        .copies
        .iter()
        .any(|c| c.kind == copy_kind::KV_RECV));
    assert_eq!(decode.tokens(2u64), reference(&p, 4));
    decode.assert_no_leak();
}

#[test]
fn a_pair_that_goes_down_fails_the_waiting_receivers() {
    let mut decode = Harness::new(config(64, 4));
    decode.submit(transfer(
        1,
        prompt(4, 21),
        6,
        KvTransfer::Recv { room: ROOM },
    ));
    decode.submit(transfer(
        2,
        prompt(5, 21),
        6,
        KvTransfer::Recv { room: ROOM + 1 },
    ));
    for _ in 0..3 {
        assert!(decode.step(), "an idle decode server polls for arrivals");
    }
    assert!(
        decode.plans.iter().all(|pl| pl.is_empty()),
        "polls run nothing"
    );
    decode.worker.kv_down = Some("ConnectionResetError: peer gone".into());
    decode.run(10);
    for id in [1u64, 2] {
        let out = decode.last_output(id);
        assert_eq!(out.finished, Some(tokenspeed_engine::FinishReason::Error));
        let message = out.error.as_deref().unwrap_or_default();
        assert!(message.contains("peer gone"), "{message}");
    }
    assert!(decode.sched.is_idle());
    decode.assert_no_leak();
}

#[test]
fn an_aborted_waiting_receiver_is_forgotten() {
    let mut decode = Harness::new(config(64, 4));
    decode.submit(transfer(
        1,
        prompt(6, 21),
        6,
        KvTransfer::Recv { room: ROOM },
    ));
    decode.step();
    assert!(decode.sched.abort(1u64.into()));
    assert_eq!(decode.sched.awaiting_kv().count(), 0);
    assert!(decode.sched.poll_kv().is_none(), "nothing left to poll for");
    decode.run(5);
    assert!(decode.sched.is_idle());
    decode.assert_no_leak();
}
