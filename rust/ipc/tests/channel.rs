//! Channel tests across threads and processes: order, no loss, broadcast, blocking, timeouts,
//! shutdown, lifecycle and futex wake-up.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tokenspeed_engine::plan::{FinishedSlot, PageTableUpdate, RequestEvent, ScheduledRequest};
use tokenspeed_engine::{Plan, StepResult, StepTiming};
use tokenspeed_ipc::{IpcError, PlanChannel, WorkerChannel};

const SEC: Option<Duration> = Some(Duration::from_secs(10));

fn name(test: &str) -> String {
    format!("ts-ipc-test-{}-{test}", std::process::id())
}

/// A deterministic plan for step `i` (sizes vary with `i`).
fn plan(i: u64) -> Plan {
    let n = (i % 7) as u32 + 1;
    Plan {
        step_id: i,
        finished: (0..(i % 3) as u32)
            .map(|slot| FinishedSlot { slot })
            .collect(),
        page_tables: vec![PageTableUpdate {
            slot: n,
            first: i as u32,
            pool: 0,
            pages: vec![i as u32; 3],
        }],
        scheduled: (0..n)
            .map(|s| ScheduledRequest {
                slot: s,
                start_pos: i as u32,
                sample: true,
                tokens: vec![s + i as u32],
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// The result a worker sends back for `p`.
fn result_for(p: &Plan) -> StepResult {
    StepResult {
        step_id: p.step_id,
        events: p
            .scheduled
            .iter()
            .map(|s| RequestEvent {
                slot: s.slot,
                tokens: vec![s.slot * 10 + p.step_id as u32],
                logprobs: vec![-(s.slot as f32)],
                top_k: u32::from(s.slot == 0) * 2,
                top_ids: if s.slot == 0 { vec![1, 2] } else { vec![] },
                top_logprobs: if s.slot == 0 {
                    vec![-0.5, -1.0]
                } else {
                    vec![]
                },
                ..Default::default()
            })
            .collect(),
        timing: vec![StepTiming {
            gpu_idle_us: p.step_id as u32 * 7,
            gpu_busy_us: p.step_id as u32 * 11,
        }],
        ..Default::default()
    }
}

#[test]
fn thread_round_trip_in_order() {
    let nm = name("rt");
    let mut server = PlanChannel::create(&nm, 4, 4096, 1).unwrap();
    let n = 2000u64;
    let worker = thread::spawn({
        let nm = nm.clone();
        move || {
            let mut w = WorkerChannel::attach(&nm, 0).unwrap();
            for i in 0..n {
                let p = w.recv_plan(SEC).unwrap().expect("plan");
                assert_eq!(p, plan(i));
                w.send_result(&result_for(&p), SEC).unwrap();
            }
        }
    });
    let receiver_results = thread::spawn(move || {
        for i in 0..n {
            server.send_plan(&plan(i), SEC).unwrap();
            // Keep at most 2 steps in flight, like the overlap scheduler.
            if i >= 1 {
                let r = server.recv_result(SEC).unwrap().expect("result");
                assert_eq!(r, result_for(&plan(i - 1)));
            }
        }
        let r = server.recv_result(SEC).unwrap().expect("last result");
        assert_eq!(r.step_id, n - 1);
        server
    });
    worker.join().unwrap();
    drop(receiver_results.join().unwrap());
}

#[test]
fn two_readers_see_every_plan() {
    let nm = name("bcast");
    let mut server = PlanChannel::create(&nm, 3, 4096, 2).unwrap();
    let n = 500u64;
    let readers: Vec<_> = (0..2)
        .map(|rank| {
            let nm = nm.clone();
            thread::spawn(move || {
                let mut w = WorkerChannel::attach(&nm, rank).unwrap();
                for i in 0..n {
                    let raw = w.recv_raw(SEC).unwrap().expect("plan").to_vec();
                    assert_eq!(
                        tokenspeed_ipc::codec::decode::<Plan>(&raw).unwrap(),
                        plan(i)
                    );
                }
            })
        })
        .collect();
    for i in 0..n {
        server.send_plan(&plan(i), SEC).unwrap();
    }
    for r in readers {
        r.join().unwrap();
    }
}

#[test]
fn recv_timeout_returns_none() {
    let nm = name("timeout");
    let server = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    let mut w = WorkerChannel::attach(&nm, 0).unwrap();
    let t = Instant::now();
    assert!(w
        .recv_plan(Some(Duration::from_millis(50)))
        .unwrap()
        .is_none());
    let dt = t.elapsed();
    assert!(
        dt >= Duration::from_millis(50) && dt < Duration::from_secs(2),
        "{dt:?}"
    );
    assert!(w.recv_raw(Some(Duration::ZERO)).unwrap().is_none());
    drop(server);
}

#[test]
fn full_ring_blocks_writer_until_all_readers_release() {
    let nm = name("full");
    let mut server = PlanChannel::create(&nm, 2, 1024, 2).unwrap();
    let mut r0 = WorkerChannel::attach(&nm, 0).unwrap();
    let mut r1 = WorkerChannel::attach(&nm, 1).unwrap();
    server.send_plan(&plan(0), SEC).unwrap();
    server.send_plan(&plan(1), SEC).unwrap();
    let short = Some(Duration::from_millis(30));
    assert!(matches!(
        server.send_plan(&plan(2), short),
        Err(IpcError::Timeout)
    ));
    // Rank 0 reads everything; rank 1 holds step 0 → still full.
    assert_eq!(r0.recv_plan(SEC).unwrap().unwrap().step_id, 0);
    assert_eq!(r0.recv_plan(SEC).unwrap().unwrap().step_id, 1);
    assert_eq!(r1.recv_raw(SEC).unwrap().map(|b| !b.is_empty()), Some(true));
    assert!(matches!(
        server.send_plan(&plan(2), short),
        Err(IpcError::Timeout)
    ));
    // A blocked writer wakes when rank 1 releases (at its next recv).
    let sent = Arc::new(AtomicBool::new(false));
    let sender = thread::spawn({
        let sent = sent.clone();
        move || {
            server.send_plan(&plan(2), SEC).unwrap();
            sent.store(true, Ordering::SeqCst);
            server
        }
    });
    thread::sleep(Duration::from_millis(50));
    assert!(!sent.load(Ordering::SeqCst), "writer did not block");
    assert_eq!(r1.recv_plan(SEC).unwrap().unwrap().step_id, 1);
    let _server = sender.join().unwrap();
    assert!(sent.load(Ordering::SeqCst));
    assert_eq!(r0.recv_plan(SEC).unwrap().unwrap().step_id, 2);
    assert_eq!(r1.recv_plan(SEC).unwrap().unwrap().step_id, 2);
}

#[test]
fn too_large_plan_is_a_typed_error() {
    let nm = name("large");
    let mut server = PlanChannel::create(&nm, 2, 512, 1).unwrap();
    let mut w = WorkerChannel::attach(&nm, 0).unwrap();
    let big = Plan {
        scheduled: vec![ScheduledRequest {
            tokens: vec![1; 1000],
            ..Default::default()
        }],
        ..Default::default()
    };
    match server.send_plan(&big, SEC) {
        Err(IpcError::TooLarge { need, cap: 512 }) => assert!(need >= 4000),
        other => panic!("{other:?}"),
    }
    server.send_plan(&plan(5), SEC).unwrap();
    assert_eq!(w.recv_plan(SEC).unwrap().unwrap(), plan(5));
}

#[test]
fn shutdown_wakes_and_fails_waiters() {
    let nm = name("shutdown");
    let server = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    let handle = server.shutdown_handle();
    let reader = thread::spawn({
        let nm = nm.clone();
        move || {
            let mut w = WorkerChannel::attach(&nm, 0).unwrap();
            let t = Instant::now();
            let r = w.recv_plan(None);
            (r.map(|_| ()), t.elapsed())
        }
    });
    thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    handle.shutdown();
    let (r, _) = reader.join().unwrap();
    assert!(matches!(r, Err(IpcError::Shutdown)), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "shutdown wakes the waiter"
    );
    drop(server);
}

#[test]
fn drop_of_creator_shuts_down_and_unlinks() {
    let nm = name("drop");
    let server = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    let mut w = WorkerChannel::attach(&nm, 0).unwrap();
    assert!(w.server_alive());
    assert!(server.reader_alive(0));
    drop(server);
    assert!(w.is_shutdown());
    assert!(matches!(w.recv_plan(SEC), Err(IpcError::Shutdown)));
    assert!(matches!(
        w.send_result(&StepResult::default(), SEC),
        Err(IpcError::Shutdown)
    ));
    assert!(matches!(
        WorkerChannel::attach(&nm, 0),
        Err(IpcError::NotFound(_))
    ));
}

#[test]
fn stale_segment_is_replaced_and_junk_rejected() {
    let nm = name("stale");
    std::fs::write(format!("/dev/shm/{nm}"), vec![0x5au8; 8192]).unwrap();
    assert!(matches!(
        WorkerChannel::attach(&nm, 0),
        Err(IpcError::BadHeader { .. } | IpcError::NotReady(_))
    ));
    let mut server = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    let mut w = WorkerChannel::attach(&nm, 0).unwrap();
    server.send_plan(&plan(1), SEC).unwrap();
    assert_eq!(w.recv_plan(SEC).unwrap().unwrap(), plan(1));
    // A second create of the same name replaces the first; the old owner's drop leaves it.
    let server2 = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    drop(server);
    assert!(WorkerChannel::attach(&nm, 0).is_ok());
    drop(server2);
    assert!(!std::path::Path::new(&format!("/dev/shm/{nm}")).exists());
}

#[test]
fn rank_checks() {
    let nm = name("rank");
    let _server = PlanChannel::create(&nm, 2, 1024, 2).unwrap();
    assert!(matches!(
        WorkerChannel::attach(&nm, 2),
        Err(IpcError::BadRank {
            rank: 2,
            n_readers: 2
        })
    ));
    let mut r1 = WorkerChannel::attach(&nm, 1).unwrap();
    assert!(matches!(
        r1.send_result(&StepResult::default(), SEC),
        Err(IpcError::NotRankZero(1))
    ));
    assert!(matches!(
        PlanChannel::create("a/b", 2, 64, 1),
        Err(IpcError::InvalidName(_))
    ));
    assert!(matches!(
        PlanChannel::create(&nm, 2, 64, 0),
        Err(IpcError::InvalidConfig(_))
    ));
}

#[test]
fn attach_wait_waits_for_the_server() {
    let nm = name("attachwait");
    let w = thread::spawn({
        let nm = nm.clone();
        move || WorkerChannel::attach_wait(&nm, 0, Duration::from_secs(10)).map(|_| ())
    });
    thread::sleep(Duration::from_millis(50));
    let _server = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    w.join().unwrap().unwrap();
    let t = Instant::now();
    let r = WorkerChannel::attach_wait(&name("never"), 0, Duration::from_millis(30));
    assert!(matches!(r, Err(IpcError::NotFound(_))));
    assert!(t.elapsed() >= Duration::from_millis(30));
}

#[test]
fn a_sleeping_worker_wakes_up() {
    let nm = name("latency");
    let mut server = PlanChannel::create(&nm, 2, 1024, 1).unwrap();
    let n = 20;
    let worker = thread::spawn({
        let nm = nm.clone();
        move || {
            let mut w = WorkerChannel::attach(&nm, 0).unwrap();
            for _ in 0..n {
                let p = w.recv_plan(SEC).unwrap().unwrap();
                w.send_result(&result_for(&p), SEC).unwrap();
            }
        }
    });
    let mut lat = vec![];
    for i in 0..n {
        // Let the worker fall asleep on the futex first.
        thread::sleep(Duration::from_millis(5));
        let t = Instant::now();
        server.send_plan(&plan(i), SEC).unwrap();
        server.recv_result(SEC).unwrap().unwrap();
        lat.push(t.elapsed());
    }
    worker.join().unwrap();
    lat.sort();
    eprintln!(
        "sleeping round trip: median {:?}, max {:?}",
        lat[n as usize / 2],
        lat[n as usize - 1]
    );
    // Liveness, not speed (timings belong in benchmarks): every sleeping worker woke up.
    assert!(lat[n as usize - 1] < Duration::from_secs(5), "{lat:?}");
}

/// Child-process side of `cross_process_ranks` (a no-op unless run as that child).
#[test]
fn child_worker() {
    let (Ok(nm), Ok(rank)) = (
        std::env::var("TS_IPC_CHILD_NAME"),
        std::env::var("TS_IPC_CHILD_RANK"),
    ) else {
        return;
    };
    let rank: u32 = rank.parse().unwrap();
    let n: u64 = std::env::var("TS_IPC_CHILD_N").unwrap().parse().unwrap();
    let mut w = WorkerChannel::attach_wait(&nm, rank, Duration::from_secs(10)).unwrap();
    for i in 0..n {
        let p = w.recv_plan(SEC).unwrap().expect("plan");
        assert_eq!(p, plan(i));
        if rank == 0 {
            w.send_result(&result_for(&p), SEC).unwrap();
        }
    }
    // The server shuts down after its last result: the next recv fails.
    assert!(matches!(w.recv_plan(SEC), Err(IpcError::Shutdown)));
}

#[test]
fn cross_process_ranks() {
    let nm = name("xproc");
    let n = 300u64;
    let mut server = PlanChannel::create(&nm, 4, 4096, 2).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "child_worker", "--nocapture", "--test-threads=1"])
                .env("TS_IPC_CHILD_NAME", &nm)
                .env("TS_IPC_CHILD_RANK", rank.to_string())
                .env("TS_IPC_CHILD_N", n.to_string())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let t = Instant::now();
    for i in 0..n {
        server.send_plan(&plan(i), SEC).unwrap();
        let r = server.recv_result(SEC).unwrap().expect("result");
        assert_eq!(r, result_for(&plan(i)));
    }
    eprintln!(
        "cross-process: {n} plan+result round trips in {:?}",
        t.elapsed()
    );
    assert!(server.reader_alive(0) && server.reader_alive(1));
    server.shutdown();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
}
