//! Mask computation time per token for a JSON schema on the Llama-3 vocab (128k ids), at batch 1
//! and batch 64 (sequential, and in parallel with rayon), plus compile and matcher-creation time.
//!
//! TOKENSPEED_TEST_ASSETS=$(python3 -m tokenspeed.launch.assets test-assets | tail -1) \
//!   cargo bench -p tokenspeed-structured --bench mask
//!
//! Each matcher follows a real output (a valid instance, tokenized), so the masks are the ones a
//! decode would ask for; a step's time is the wall time to fill every matcher's row.

use rayon::prelude::*;
use serde_json::json;
use std::time::{Duration, Instant};
use tokenspeed_structured::{GrammarCompiler, GrammarSpec, Matcher};
use tokenspeed_text::TextTokenizer;

fn schema() -> serde_json::Value {
    json!({
        "title": "Order", "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
            "customer": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 64},
                "email": {"type": "string", "format": "email"},
                "tier": {"enum": ["free", "pro", "enterprise"]}},
                "required": ["name", "email", "tier"], "additionalProperties": false},
            "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {
                "type": "object", "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
                "required": ["sku", "quantity", "unit_price"], "additionalProperties": false}},
            "shipping": {"anyOf": [
                {"type": "object", "properties": {"method": {"const": "pickup"},
                                                  "store_id": {"type": "integer"}},
                 "required": ["method", "store_id"], "additionalProperties": false},
                {"type": "object", "properties": {"method": {"const": "delivery"},
                                                  "address": {"type": "string"}},
                 "required": ["method", "address"], "additionalProperties": false}]},
            "notes": {"type": ["string", "null"]},
            "paid": {"type": "boolean"}},
        "required": ["order_id", "customer", "items", "shipping", "paid"],
        "additionalProperties": false
    })
}

fn instances() -> Vec<String> {
    let a = json!({"order_id": "AB-123456",
        "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
        "items": [{"sku": "KB-001", "quantity": 2, "unit_price": 49.99, "tags": ["keyboard", "usb"]},
                  {"sku": "MS-042", "quantity": 1, "unit_price": 19.5}],
        "shipping": {"method": "delivery", "address": "12 Analytical St, London"},
        "notes": "Leave at the door, please.", "paid": true});
    let b = json!({"order_id": "ZX-000042",
        "customer": {"name": "Grace Hopper", "email": "grace@navy.mil", "tier": "enterprise"},
        "items": [{"sku": "CBL-9", "quantity": 120, "unit_price": 0.75, "tags": []}],
        "shipping": {"method": "pickup", "store_id": 17}, "notes": null, "paid": false});
    vec![
        serde_json::to_string_pretty(&a).unwrap(),
        serde_json::to_string(&b).unwrap(),
    ]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(name: &str, per_step: &mut [Duration], rows_per_step: usize) {
    per_step.sort();
    let total: Duration = per_step.iter().sum();
    let mean = total / per_step.len() as u32;
    println!(
        "{name:<34} steps {:>4}  per step mean {:>9.1?} p50 {:>9.1?} p99 {:>9.1?}  per token {:>8.1?}",
        per_step.len(),
        mean,
        percentile(per_step, 0.5),
        percentile(per_step, 0.99),
        mean / rows_per_step as u32,
    );
}

/// Runs `batch` matchers along the instances' token sequences (matcher i follows instance
/// i % n), filling all rows each step with `fill`, and returns the per-step times.
fn run(
    compiler: &GrammarCompiler,
    spec: &GrammarSpec,
    sequences: &[Vec<u32>],
    batch: usize,
    parallel: bool,
) -> Vec<Duration> {
    let compiled = compiler.compile(spec).unwrap();
    let mut matchers: Vec<(Matcher, &Vec<u32>)> = (0..batch)
        .map(|i| (compiled.matcher(), &sequences[i % sequences.len()]))
        .collect();
    let words = compiler.bitmask_words();
    let mut masks = vec![0u32; words * batch];
    let steps = sequences.iter().map(Vec::len).min().unwrap();
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps {
        let t = Instant::now();
        if parallel {
            masks
                .par_chunks_mut(words)
                .zip(matchers.par_iter_mut())
                .for_each(|(row, (m, _))| m.fill_next_token_bitmask(row).unwrap());
        } else {
            for (row, (m, _)) in masks.chunks_mut(words).zip(matchers.iter_mut()) {
                m.fill_next_token_bitmask(row).unwrap();
            }
        }
        times.push(t.elapsed());
        for (row, (m, seq)) in masks.chunks(words).zip(matchers.iter_mut()) {
            let token = seq[step];
            assert!(
                row[token as usize / 32] >> (token % 32) & 1 == 1,
                "step {step}: mask refuses the instance"
            );
            m.consume_token(token).unwrap();
        }
    }
    times
}

fn main() {
    let dir = std::env::var_os("TOKENSPEED_TEST_ASSETS").expect(
        "set TOKENSPEED_TEST_ASSETS (python3 -m tokenspeed.launch.assets test-assets | tail -1)",
    );
    let tok = TextTokenizer::from_dir(&std::path::Path::new(&dir).join("llama3"), None).unwrap();
    // Llama-3's embedding has 128256 rows; the tokenizer as many ids.
    let vocab = tok.vocab_size();
    let t = Instant::now();
    let compiler = GrammarCompiler::new(&tok, vocab).unwrap();
    println!(
        "vocab {vocab}; token trie + compiler built in {:.1?}",
        t.elapsed()
    );
    println!("threads for rayon: {}", rayon::current_num_threads());

    let spec = GrammarSpec::JsonSchema(schema());
    let t = Instant::now();
    let compiled = compiler.compile(&spec).unwrap();
    println!("compile (first, uncached): {:.1?}", t.elapsed());
    let t = Instant::now();
    compiler.compile(&spec).unwrap();
    println!("compile (cached):          {:.1?}", t.elapsed());
    let t = Instant::now();
    let n = 100;
    for _ in 0..n {
        std::hint::black_box(compiled.matcher());
    }
    println!("matcher creation:          {:.1?}", t.elapsed() / n);

    let sequences: Vec<Vec<u32>> = instances()
        .iter()
        .map(|text| tok.encode(text, false).unwrap())
        .collect();
    println!(
        "instances: {} and {} tokens (the run follows the shorter length)",
        sequences[0].len(),
        sequences[1].len()
    );
    // A warm-up run, so the first measured matcher does not pay the lexer cache's first fills.
    run(&compiler, &spec, &sequences, 1, false);
    report(
        "batch 1",
        &mut run(&compiler, &spec, &sequences, 1, false),
        1,
    );
    report(
        "batch 64, sequential",
        &mut run(&compiler, &spec, &sequences, 64, false),
        64,
    );
    report(
        "batch 64, rayon",
        &mut run(&compiler, &spec, &sequences, 64, true),
        64,
    );
}
