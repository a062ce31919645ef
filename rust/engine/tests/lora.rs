//! LoRA adapters in the scheduler: the prefix cache is keyed by adapter, and at most
//! `limit_adapters` adapters run at once.

mod common;

use common::{config, prompt, request, Harness};
use tokenspeed_engine::Request;

fn on_adapter(id: u64, prompt: Vec<u32>, adapter: u32) -> Request {
    let mut req = request(id, prompt, 2);
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
