//! Shared test fixtures: the real tokenizers under `TOKENSPEED_TEST_ASSETS` and synthetic sentencepiece ones.
#![allow(dead_code)]

use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use tokenspeed_text::{IncrementalDetokenizer, TextTokenizer};

pub const ASSETS_ENV: &str = "TOKENSPEED_TEST_ASSETS";

/// The assets dir (holding `smollm2/`, `llama3/`, `qwen2/`). Missing assets fail the test loudly:
/// a silently skipped tokenizer test is worse than a red one.
pub fn assets_dir() -> PathBuf {
    let dir = std::env::var_os(ASSETS_ENV).unwrap_or_else(|| {
        panic!("{ASSETS_ENV} is not set: point it at a dir containing smollm2/, llama3/ and qwen2/ (HF tokenizer dirs)")
    });
    let dir = PathBuf::from(dir);
    for name in ["smollm2", "llama3", "qwen2"] {
        let file = dir.join(name).join("tokenizer.json");
        assert!(
            file.is_file(),
            "{ASSETS_ENV}={}: missing {}",
            dir.display(),
            file.display()
        );
    }
    dir
}

pub fn load_asset(name: &str) -> TextTokenizer {
    let dir = assets_dir().join(name);
    TextTokenizer::from_dir(&dir, None).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

pub static SMOLLM2: LazyLock<TextTokenizer> = LazyLock::new(|| load_asset("smollm2"));
pub static LLAMA3: LazyLock<TextTokenizer> = LazyLock::new(|| load_asset("llama3"));
pub static QWEN2: LazyLock<TextTokenizer> = LazyLock::new(|| load_asset("qwen2"));
pub static SPM_LEGACY: LazyLock<TextTokenizer> = LazyLock::new(|| {
    TextTokenizer::from_dir(&sentencepiece_dir("spm-legacy", SpmStyle::Legacy), None)
        .expect("synthetic legacy sentencepiece tokenizer")
});
pub static SPM_METASPACE: LazyLock<TextTokenizer> = LazyLock::new(|| {
    TextTokenizer::from_dir(
        &sentencepiece_dir("spm-metaspace", SpmStyle::Metaspace),
        None,
    )
    .expect("synthetic metaspace tokenizer")
});

/// Every tokenizer under test, with a name for assertion messages.
pub fn all_tokenizers() -> Vec<(&'static str, &'static TextTokenizer)> {
    vec![
        ("smollm2", &*SMOLLM2),
        ("llama3", &*LLAMA3),
        ("qwen2", &*QWEN2),
        ("spm-legacy", &*SPM_LEGACY),
        ("spm-metaspace", &*SPM_METASPACE),
    ]
}

/// A fresh, empty scratch dir unique to this process and `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tokenspeed-text-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

pub fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_string_pretty(value).expect("json")).expect("write");
}

/// Streams `ids` through an `IncrementalDetokenizer`, returning every delta (finish last).
pub fn stream(tok: &TextTokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut detok = IncrementalDetokenizer::new(skip_special_tokens);
    let mut deltas: Vec<String> = ids
        .iter()
        .map(|&id| detok.push(tok, id).expect("push"))
        .collect();
    deltas.push(detok.finish(tok).expect("finish"));
    deltas
}

#[derive(Clone, Copy)]
pub enum SpmStyle {
    /// Llama-2: normalizer prepends "▁" and maps spaces; decoder Replace+ByteFallback+Fuse+Strip.
    Legacy,
    /// Mistral-style: Metaspace pre-tokenizer (prepend "first"); decoder ByteFallback+Metaspace.
    Metaspace,
}

/// Writes a small Llama-2-like BPE tokenizer with byte fallback: ASCII letters, a few CJK and
/// merged words are in the vocab; emoji, Cyrillic, newlines etc. fall back to `<0x..>` bytes.
pub fn sentencepiece_dir(name: &str, style: SpmStyle) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    let mut add = |piece: String| {
        let id = vocab.len();
        vocab.entry(piece).or_insert(json!(id));
    };
    for special in ["<unk>", "<s>", "</s>"] {
        add(special.into());
    }
    for byte in 0..=255u8 {
        add(format!("<0x{byte:02X}>"));
    }
    let singles = ('a'..='z').chain('A'..='Z').chain('0'..='9');
    for c in singles.chain("▁,.!?'中文日本語éñ".chars()) {
        add(c.to_string());
    }
    let merges = [
        "▁ t",
        "h e",
        "▁t he",
        "l l",
        "e ll",
        "▁ w",
        "o r",
        "▁w or",
        "l d",
        "▁wor ld",
        "▁ H",
        "▁H ell",
        "中 文",
    ];
    for m in merges {
        add(m.replace(' ', ""));
    }
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let (normalizer, pre_tokenizer, decoder) = match style {
        SpmStyle::Legacy => (
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}),
            json!(null),
            json!({"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}),
        ),
        SpmStyle::Metaspace => (
            json!(null),
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}),
            json!({"type": "Sequence", "decoders": [
                {"type": "ByteFallback"},
                {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}]}),
        ),
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let dir = scratch_dir(name);
    write_json(&dir.join("tokenizer.json"), &tokenizer);
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "bos_token": {"content": "<s>", "lstrip": false, "normalized": false,
                          "rstrip": false, "single_word": false},
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
        }),
    );
    dir
}

/// A BERT-like WordPiece tokenizer: its decoder puts a space between tokens, added tokens
/// included (`[CLS] hello [SEP] [SEP]`). Ids: [UNK] 0, [CLS] 1, [SEP] 2, hello 3, world 4,
/// ##s 5, and the added non-special token <tool> 6.
pub static WORDPIECE: LazyLock<TextTokenizer> = LazyLock::new(|| {
    let added = |id: u32, content: &str, special: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": !special, "special": special})
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(1, "[CLS]", true), added(2, "[SEP]", true), added(6, "<tool>", false)],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}},
    });
    let dir = scratch_dir("wordpiece");
    write_json(&dir.join("tokenizer.json"), &tokenizer);
    TextTokenizer::from_dir(&dir, None).expect("synthetic wordpiece tokenizer")
});
