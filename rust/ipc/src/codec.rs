//! Flat little-endian encoding of `Plan` and `StepResult` into a slot payload.
//!
//! A payload is a small header (magic, counts, step id) followed by contiguous arrays, each
//! starting at an 8-byte aligned offset. Offsets follow from the counts (`plan_layout`,
//! `result_layout`), so encoder, decoder and the numpy views of the Python binding agree by
//! construction. The layout is private to this crate and its binding.

use tokenspeed_engine::plan::{NewRequestPlan, PageTableUpdate, SampledToken, ScheduledRequest};
use tokenspeed_engine::{Plan, SamplingParams, StepResult};

use crate::IpcError;

const PLAN_MAGIC: u32 = 0x4e4c_5054; // "TPLN"
const RESULT_MAGIC: u32 = 0x5345_5254; // "TRES"
const PLAN_HEADER: usize = 40;
const RESULT_HEADER: usize = 24;
/// Top-k padding id: entries that asked for fewer top logprobs than the step's k.
pub const TOP_PAD_ID: u32 = u32::MAX;

/// Element type of one flat array (numpy spelling via [`DType::numpy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    U8,
    U32,
    I32,
    F32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::I64 => 8,
        }
    }
    /// numpy dtype string (explicitly little-endian).
    pub fn numpy(self) -> &'static str {
        match self {
            DType::U8 => "u1",
            DType::U32 => "<u4",
            DType::I32 => "<i4",
            DType::F32 => "<f4",
            DType::I64 => "<i8",
        }
    }
}

/// Where one array lies in a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayDesc {
    pub name: &'static str,
    pub dtype: DType,
    /// Byte offset from the start of the payload (a multiple of 8).
    pub offset: usize,
    /// Number of elements.
    pub count: usize,
    /// Whether the Python worker sees it (`python/tokenspeed/plan.py::StepPlan` fields).
    pub worker_visible: bool,
}

// Counts of a plan: finished, new, page-table updates, page ids, scheduled, tokens.
const N_FIN: usize = 0;
const N_NEW: usize = 1;
const N_PT: usize = 2;
const N_PAGES: usize = 3;
const N_SCHED: usize = 4;
const N_TOK: usize = 5;

/// (name, dtype, which count, worker-visible), in payload order.
const PLAN_ARRAYS: [(&str, DType, usize, bool); 21] = [
    ("finished_slots", DType::U32, N_FIN, true),
    ("new_slots", DType::U32, N_NEW, true),
    ("new_temperature", DType::F32, N_NEW, true),
    ("new_top_p", DType::F32, N_NEW, true),
    ("new_top_k", DType::I32, N_NEW, true),
    ("new_min_p", DType::F32, N_NEW, true),
    ("new_repetition_penalty", DType::F32, N_NEW, true),
    ("new_frequency_penalty", DType::F32, N_NEW, true),
    ("new_presence_penalty", DType::F32, N_NEW, true),
    ("new_seed", DType::I64, N_NEW, true),
    ("new_top_logprobs", DType::U32, N_NEW, true),
    ("pt_slots", DType::U32, N_PT, true),
    ("pt_first", DType::U32, N_PT, true),
    ("pt_count", DType::U32, N_PT, true),
    ("pt_pages", DType::U32, N_PAGES, true),
    ("slots", DType::U32, N_SCHED, true),
    ("num_tokens", DType::U32, N_SCHED, true),
    ("start_pos", DType::U32, N_SCHED, true),
    ("cached_len", DType::U32, N_SCHED, false),
    ("sample", DType::U8, N_SCHED, true),
    ("input_ids", DType::U32, N_TOK, true),
];

/// Layout of a payload: its arrays and its total length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub step_id: u64,
    pub arrays: Vec<ArrayDesc>,
    pub total: usize,
}

impl Layout {
    pub fn array(&self, name: &str) -> Option<&ArrayDesc> {
        self.arrays.iter().find(|a| a.name == name)
    }
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

fn layout(step_id: u64, header: usize, specs: &[(&'static str, DType, usize, bool)]) -> Layout {
    let mut off = header;
    let arrays = specs
        .iter()
        .map(|&(name, dtype, count, worker_visible)| {
            let a = ArrayDesc {
                name,
                dtype,
                offset: off,
                count,
                worker_visible,
            };
            off = align8(off + count * dtype.size());
            a
        })
        .collect();
    Layout {
        step_id,
        arrays,
        total: off,
    }
}

fn plan_layout(step_id: u64, counts: [usize; 6]) -> Layout {
    let specs: Vec<_> = PLAN_ARRAYS
        .iter()
        .map(|&(n, d, c, v)| (n, d, counts[c], v))
        .collect();
    layout(step_id, PLAN_HEADER, &specs)
}

fn plan_counts(plan: &Plan) -> [usize; 6] {
    [
        plan.finished_slots.len(),
        plan.new_requests.len(),
        plan.page_table_updates.len(),
        plan.page_table_updates.iter().map(|u| u.pages.len()).sum(),
        plan.scheduled.len(),
        plan.input_ids.len(),
    ]
}

/// Bytes `plan` takes once encoded.
pub fn plan_encoded_len(plan: &Plan) -> usize {
    plan_layout(plan.step_id, plan_counts(plan)).total
}

fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(buf[off..off + 4].try_into().unwrap())
}

fn get_u64(buf: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(buf[off..off + 8].try_into().unwrap())
}

/// Writes an array's elements (`N` bytes each) at its offset.
fn put_array<const N: usize>(buf: &mut [u8], a: &ArrayDesc, vals: impl Iterator<Item = [u8; N]>) {
    let dst = &mut buf[a.offset..a.offset + a.count * N];
    let mut n = 0;
    for (chunk, v) in dst.chunks_exact_mut(N).zip(vals) {
        chunk.copy_from_slice(&v);
        n += 1;
    }
    debug_assert_eq!(n, a.count, "array {} length", a.name);
}

fn get_array<'a, const N: usize>(
    buf: &'a [u8],
    a: &ArrayDesc,
) -> impl Iterator<Item = [u8; N]> + 'a {
    buf[a.offset..a.offset + a.count * N]
        .chunks_exact(N)
        .map(|c| c.try_into().unwrap())
}

/// Encodes `plan` into `buf`; returns the bytes written. Err(TooLarge) if `buf` is too small.
/// Seeds are sent as int64 with -1 = none, so a seed keeps its low 63 bits.
pub fn encode_plan(plan: &Plan, buf: &mut [u8]) -> Result<usize, IpcError> {
    let counts = plan_counts(plan);
    let lay = plan_layout(plan.step_id, counts);
    if lay.total > buf.len() {
        return Err(IpcError::TooLarge {
            need: lay.total,
            cap: buf.len(),
        });
    }
    if counts.iter().any(|&c| c > u32::MAX as usize) {
        return Err(IpcError::TooLarge {
            need: usize::MAX,
            cap: buf.len(),
        });
    }
    put_u32(buf, 0, PLAN_MAGIC);
    put_u32(buf, 4, 0);
    buf[8..16].copy_from_slice(&plan.step_id.to_le_bytes());
    for (i, &c) in counts.iter().enumerate() {
        put_u32(buf, 16 + 4 * i, c as u32);
    }
    let a = &lay.arrays;
    let nr = &plan.new_requests;
    let sp = |f: fn(&SamplingParams) -> [u8; 4]| nr.iter().map(move |r| f(&r.sampling));
    let pt = &plan.page_table_updates;
    let sc = &plan.scheduled;
    put_array(
        buf,
        &a[0],
        plan.finished_slots.iter().map(|s| s.to_le_bytes()),
    );
    put_array(buf, &a[1], nr.iter().map(|r| r.slot.to_le_bytes()));
    put_array(buf, &a[2], sp(|s| s.temperature.to_le_bytes()));
    put_array(buf, &a[3], sp(|s| s.top_p.to_le_bytes()));
    put_array(buf, &a[4], sp(|s| s.top_k.to_le_bytes()));
    put_array(buf, &a[5], sp(|s| s.min_p.to_le_bytes()));
    put_array(buf, &a[6], sp(|s| s.repetition_penalty.to_le_bytes()));
    put_array(buf, &a[7], sp(|s| s.frequency_penalty.to_le_bytes()));
    put_array(buf, &a[8], sp(|s| s.presence_penalty.to_le_bytes()));
    let seed = |s: Option<u64>| s.map_or(-1i64, |v| (v & i64::MAX as u64) as i64);
    put_array(
        buf,
        &a[9],
        nr.iter().map(|r| seed(r.sampling.seed).to_le_bytes()),
    );
    put_array(buf, &a[10], sp(|s| s.top_logprobs.to_le_bytes()));
    put_array(buf, &a[11], pt.iter().map(|u| u.slot.to_le_bytes()));
    put_array(buf, &a[12], pt.iter().map(|u| u.first_index.to_le_bytes()));
    put_array(
        buf,
        &a[13],
        pt.iter().map(|u| (u.pages.len() as u32).to_le_bytes()),
    );
    put_array(
        buf,
        &a[14],
        pt.iter()
            .flat_map(|u| u.pages.iter().map(|p| p.to_le_bytes())),
    );
    put_array(buf, &a[15], sc.iter().map(|r| r.slot.to_le_bytes()));
    put_array(buf, &a[16], sc.iter().map(|r| r.num_tokens.to_le_bytes()));
    put_array(buf, &a[17], sc.iter().map(|r| r.start_pos.to_le_bytes()));
    put_array(buf, &a[18], sc.iter().map(|r| r.cached_len.to_le_bytes()));
    put_array(buf, &a[19], sc.iter().map(|r| [r.sample as u8]));
    put_array(buf, &a[20], plan.input_ids.iter().map(|t| t.to_le_bytes()));
    Ok(lay.total)
}

/// Reads and checks the layout of an encoded plan.
pub fn plan_layout_of(buf: &[u8]) -> Result<Layout, IpcError> {
    if buf.len() < PLAN_HEADER || get_u32(buf, 0) != PLAN_MAGIC {
        return Err(IpcError::Corrupt("not a plan payload".into()));
    }
    let mut counts = [0usize; 6];
    for (i, c) in counts.iter_mut().enumerate() {
        *c = get_u32(buf, 16 + 4 * i) as usize;
    }
    let lay = plan_layout(get_u64(buf, 8), counts);
    if lay.total > buf.len() {
        return Err(IpcError::Corrupt(format!(
            "plan needs {} bytes, has {}",
            lay.total,
            buf.len()
        )));
    }
    Ok(lay)
}

fn u32s(buf: &[u8], a: &ArrayDesc) -> Vec<u32> {
    get_array(buf, a).map(u32::from_le_bytes).collect()
}

fn f32s(buf: &[u8], a: &ArrayDesc) -> Vec<f32> {
    get_array(buf, a).map(f32::from_le_bytes).collect()
}

/// Decodes an encoded plan (copying it out of the slot).
pub fn decode_plan(buf: &[u8]) -> Result<Plan, IpcError> {
    let lay = plan_layout_of(buf)?;
    let a = &lay.arrays;
    let new_slots = u32s(buf, &a[1]);
    let (temp, top_p, min_p) = (f32s(buf, &a[2]), f32s(buf, &a[3]), f32s(buf, &a[5]));
    let top_k: Vec<i32> = get_array(buf, &a[4]).map(i32::from_le_bytes).collect();
    let (rep, freq, pres) = (f32s(buf, &a[6]), f32s(buf, &a[7]), f32s(buf, &a[8]));
    let seeds: Vec<i64> = get_array(buf, &a[9]).map(i64::from_le_bytes).collect();
    let top_lp = u32s(buf, &a[10]);
    let new_requests = (0..new_slots.len())
        .map(|i| NewRequestPlan {
            slot: new_slots[i],
            sampling: SamplingParams {
                temperature: temp[i],
                top_p: top_p[i],
                top_k: top_k[i],
                min_p: min_p[i],
                repetition_penalty: rep[i],
                frequency_penalty: freq[i],
                presence_penalty: pres[i],
                seed: (seeds[i] >= 0).then_some(seeds[i] as u64),
                top_logprobs: top_lp[i],
            },
        })
        .collect();
    let (pt_slots, pt_first, pt_count) = (u32s(buf, &a[11]), u32s(buf, &a[12]), u32s(buf, &a[13]));
    let pages = u32s(buf, &a[14]);
    if pt_count.iter().map(|&c| c as usize).sum::<usize>() != pages.len() {
        return Err(IpcError::Corrupt("page-table counts do not add up".into()));
    }
    let mut rest = &pages[..];
    let page_table_updates = (0..pt_slots.len())
        .map(|i| {
            let (mine, tail) = rest.split_at(pt_count[i] as usize);
            rest = tail;
            PageTableUpdate {
                slot: pt_slots[i],
                first_index: pt_first[i],
                pages: mine.to_vec(),
            }
        })
        .collect();
    let (slots, ntok, start) = (u32s(buf, &a[15]), u32s(buf, &a[16]), u32s(buf, &a[17]));
    let cached = u32s(buf, &a[18]);
    let sample: Vec<u8> = get_array::<1>(buf, &a[19]).map(|b| b[0]).collect();
    let scheduled = (0..slots.len())
        .map(|i| ScheduledRequest {
            slot: slots[i],
            num_tokens: ntok[i],
            start_pos: start[i],
            cached_len: cached[i],
            sample: sample[i] != 0,
        })
        .collect();
    Ok(Plan {
        step_id: lay.step_id,
        finished_slots: u32s(buf, &a[0]),
        new_requests,
        page_table_updates,
        scheduled,
        input_ids: u32s(buf, &a[20]),
    })
}

/// A step result as raw little-endian arrays (what the Python worker has from numpy).
#[derive(Debug, Clone, Copy)]
pub struct ResultBytes<'a> {
    pub step_id: u64,
    /// Columns of `top_ids`/`top_logprobs` (0 when no entry asked for top logprobs).
    pub top_k: u32,
    pub slots: &'a [u8],
    pub tokens: &'a [u8],
    pub logprobs: &'a [u8],
    pub top_ids: &'a [u8],
    pub top_logprobs: &'a [u8],
}

fn result_layout(step_id: u64, n: usize, k: usize) -> Layout {
    let specs = [
        ("slots", DType::U32, n, true),
        ("tokens", DType::U32, n, true),
        ("logprobs", DType::F32, n, true),
        ("top_ids", DType::U32, n * k, true),
        ("top_logprobs", DType::F32, n * k, true),
    ];
    layout(step_id, RESULT_HEADER, &specs)
}

impl ResultBytes<'_> {
    /// Number of entries; checks that every array has a consistent length.
    pub fn entries(&self) -> Result<usize, IpcError> {
        let n = self.slots.len() / 4;
        let nk = n * self.top_k as usize;
        let ok = self.slots.len() == 4 * n
            && self.tokens.len() == 4 * n
            && self.logprobs.len() == 4 * n
            && self.top_ids.len() == 4 * nk
            && self.top_logprobs.len() == 4 * nk
            && n <= u32::MAX as usize;
        if !ok {
            return Err(IpcError::BadResult(format!(
                "lengths slots={} tokens={} logprobs={} top_ids={} top_logprobs={} (top_k {})",
                self.slots.len(),
                self.tokens.len(),
                self.logprobs.len(),
                self.top_ids.len(),
                self.top_logprobs.len(),
                self.top_k
            )));
        }
        Ok(n)
    }

    pub fn encoded_len(&self) -> Result<usize, IpcError> {
        let n = self.entries()?;
        Ok(result_layout(self.step_id, n, self.top_k as usize).total)
    }
}

/// Encodes raw result arrays into `buf`; returns the bytes written.
pub fn encode_result_bytes(r: &ResultBytes, buf: &mut [u8]) -> Result<usize, IpcError> {
    let n = r.entries()?;
    let lay = result_layout(r.step_id, n, r.top_k as usize);
    if lay.total > buf.len() {
        return Err(IpcError::TooLarge {
            need: lay.total,
            cap: buf.len(),
        });
    }
    put_u32(buf, 0, RESULT_MAGIC);
    put_u32(buf, 4, n as u32);
    buf[8..16].copy_from_slice(&r.step_id.to_le_bytes());
    put_u32(buf, 16, r.top_k);
    put_u32(buf, 20, 0);
    let parts = [r.slots, r.tokens, r.logprobs, r.top_ids, r.top_logprobs];
    for (a, src) in lay.arrays.iter().zip(parts) {
        buf[a.offset..a.offset + src.len()].copy_from_slice(src);
    }
    Ok(lay.total)
}

/// Flattens a `StepResult` (k = the most top logprobs of any entry; shorter rows are padded
/// with `TOP_PAD_ID` / -inf) and encodes it into `buf`.
pub fn encode_result(r: &StepResult, buf: &mut [u8]) -> Result<usize, IpcError> {
    let k = r
        .sampled
        .iter()
        .map(|s| s.top_logprobs.len())
        .max()
        .unwrap_or(0);
    let le = |it: &mut dyn Iterator<Item = [u8; 4]>| it.flatten().collect::<Vec<u8>>();
    let s = &r.sampled;
    let padded = |s: &SampledToken| {
        let pad = std::iter::repeat((TOP_PAD_ID, f32::NEG_INFINITY));
        s.top_logprobs
            .iter()
            .copied()
            .chain(pad)
            .take(k)
            .collect::<Vec<_>>()
    };
    let tops: Vec<(u32, f32)> = s.iter().flat_map(padded).collect();
    let bytes = ResultBytes {
        step_id: r.step_id,
        top_k: k as u32,
        slots: &le(&mut s.iter().map(|e| e.slot.to_le_bytes())),
        tokens: &le(&mut s.iter().map(|e| e.token.to_le_bytes())),
        logprobs: &le(&mut s.iter().map(|e| e.logprob.to_le_bytes())),
        top_ids: &le(&mut tops.iter().map(|t| t.0.to_le_bytes())),
        top_logprobs: &le(&mut tops.iter().map(|t| t.1.to_le_bytes())),
    };
    encode_result_bytes(&bytes, buf)
}

/// Bytes `r` takes once encoded.
pub fn result_encoded_len(r: &StepResult) -> usize {
    let k = r
        .sampled
        .iter()
        .map(|s| s.top_logprobs.len())
        .max()
        .unwrap_or(0);
    result_layout(r.step_id, r.sampled.len(), k).total
}

/// Decodes an encoded result. Top-k rows drop their `TOP_PAD_ID` padding; rows the worker
/// filled to k keep all k entries (the server trims to what each request asked for).
pub fn decode_result(buf: &[u8]) -> Result<StepResult, IpcError> {
    if buf.len() < RESULT_HEADER || get_u32(buf, 0) != RESULT_MAGIC {
        return Err(IpcError::Corrupt("not a result payload".into()));
    }
    let (n, k) = (get_u32(buf, 4) as usize, get_u32(buf, 16) as usize);
    let lay = result_layout(get_u64(buf, 8), n, k);
    if lay.total > buf.len() {
        return Err(IpcError::Corrupt(format!(
            "result needs {} bytes, has {}",
            lay.total,
            buf.len()
        )));
    }
    let a = &lay.arrays;
    let (slots, tokens, lps) = (u32s(buf, &a[0]), u32s(buf, &a[1]), f32s(buf, &a[2]));
    let (top_ids, top_lps) = (u32s(buf, &a[3]), f32s(buf, &a[4]));
    let sampled = (0..n)
        .map(|i| SampledToken {
            slot: slots[i],
            token: tokens[i],
            logprob: lps[i],
            top_logprobs: (i * k..(i + 1) * k)
                .filter(|&j| top_ids[j] != TOP_PAD_ID)
                .map(|j| (top_ids[j], top_lps[j]))
                .collect(),
        })
        .collect();
    Ok(StepResult {
        step_id: lay.step_id,
        sampled,
    })
}
