//! LoRA adapters in the scheduler: the prefix cache is keyed by adapter, and at most
//! `limit_adapters` adapters run at once, pinned ones counted whether they run or not.

mod common;

use common::{config, prompt, request, Harness};
use tokenspeed_engine::{LoraPin, Request};

fn on_adapter(id: u64, prompt: Vec<u32>, adapter: u32) -> Request {
    generating_on(id, prompt, adapter, 2)
}

fn generating_on(id: u64, prompt: Vec<u32>, adapter: u32, max_new_tokens: u32) -> Request {
    let mut req = request(id, prompt, max_new_tokens);
    req.sampling.lora_id = adapter;
    req.sampling.lora_path = format!("/adapters/{adapter}").into_bytes();
    req
}

#[test]
fn prefix_cache_is_shared_within_an_adapter_never_across() {
    let mut h = Harness::new(config(256, 4));
    let shared = prompt(3, 16);
    h.submit(on_adapter(1, shared.clone(), 7));
    h.run(10);
    // Another adapter and the base model compute the whole prompt; the same adapter reuses it.
    h.submit(on_adapter(2, [shared.clone(), vec![5]].concat(), 8));
    h.submit(request(3, [shared.clone(), vec![6]].concat(), 2));
    h.run(20);
    h.submit(on_adapter(4, [shared.clone(), vec![7]].concat(), 7));
    h.run(20);
    assert_eq!(h.last_output(2).cached_tokens, 0);
    assert_eq!(h.last_output(3).cached_tokens, 0);
    assert_eq!(h.last_output(4).cached_tokens, 16);
    let new = h
        .plans
        .iter()
        .flat_map(|p| &p.new_requests)
        .collect::<Vec<_>>();
    assert_eq!(
        new.iter().map(|r| r.lora_id).collect::<Vec<_>>(),
        [7, 8, 0, 7]
    );
    assert_eq!(new[1].lora_path, b"/adapters/8");
    h.assert_no_leak();
}

#[test]
fn adapters_per_batch_are_bounded_and_the_base_model_is_not_counted() {
    let mut h = Harness::new(config(512, 4));
    h.sched.limit_adapters(2);
    for (id, adapter) in [(1, 1), (2, 2), (3, 3), (4, 0), (5, 1)] {
        h.submit(on_adapter(id, prompt(id as u32, 8), adapter));
    }
    h.step();
    let first: Vec<u32> = h.plans[0].new_requests.iter().map(|r| r.lora_id).collect();
    assert_eq!(
        first,
        [1, 2, 0, 1],
        "adapter 3 waits; the base model and adapter 1 go ahead"
    );
    h.run(50);
    for id in 1..=5 {
        assert!(h.finish_reason(id).is_some(), "request {id} finished");
    }
    h.assert_no_leak();
}

/// The adapters of the requests the plans so far started, in order.
fn started(h: &Harness) -> Vec<u32> {
    h.plans
        .iter()
        .flat_map(|p| &p.new_requests)
        .map(|r| r.lora_id)
        .collect()
}

#[test]
fn a_pinned_adapter_keeps_its_slot_and_every_plan_names_it() {
    let mut h = Harness::new(config(512, 4));
    h.sched.limit_adapters(2);
    h.sched.pin_adapters(vec![9]);
    for (id, adapter) in [(1, 1), (2, 2), (3, 9), (4, 0)] {
        h.submit(generating_on(id, prompt(id as u32, 8), adapter, 6));
    }
    h.step();
    assert_eq!(
        started(&h),
        [1, 9, 0],
        "adapter 2 would take pinned 9's slot; 9 and the base model go ahead"
    );
    h.run(50);
    assert_eq!(started(&h), [1, 9, 0, 2], "2 starts once 1 is done");
    for id in 1..=4 {
        assert!(h.finish_reason(id).is_some(), "request {id} finished");
    }
    assert!(h
        .plans
        .iter()
        .all(|p| p.lora_pins == [LoraPin { adapter: 9 }]));
    h.assert_no_leak();
}

#[test]
fn unpinning_gives_the_slot_back_at_once() {
    let mut h = Harness::new(config(512, 4));
    h.sched.limit_adapters(2);
    h.sched.pin_adapters(vec![9]);
    h.submit(generating_on(1, prompt(1, 8), 1, 20));
    h.submit(generating_on(2, prompt(2, 8), 2, 20));
    h.step();
    assert_eq!(started(&h), [1]);
    h.sched.pin_adapters(Vec::new());
    h.step();
    assert_eq!(
        started(&h),
        [1, 2],
        "2 runs beside 1 without waiting for it"
    );
    assert!(h.plans.last().is_some_and(|p| p.lora_pins.is_empty()));
    h.run(80);
    h.assert_no_leak();
}
