//! TextTokenizer loading: encode/decode against HF, special tokens and eos ids from the configs.

mod common;

use common::{assets_dir, scratch_dir, write_json, LLAMA3, QWEN2, SMOLLM2};
use serde_json::json;
use tokenspeed_text::{TextError, TextTokenizer};

#[test]
fn text_tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TextTokenizer>();
}

#[test]
fn smollm2_encodes_like_hf_and_loads_special_tokens() {
    let tok = &*SMOLLM2;
    assert_eq!(
        tok.encode("Hello world", true).expect("encode"),
        [19556, 905]
    );
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.eos_token_ids(), [2]);
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert!(tok.has_chat_template());
}

#[test]
fn tokenizer_json_alone_loads_without_special_tokens() {
    for tok in [&*LLAMA3, &*QWEN2] {
        assert!(tok.eos_token_ids().is_empty());
        assert_eq!(tok.bos_token_id(), None);
        let ids = tok.encode("round trip ✓", false).expect("encode");
        assert_eq!(tok.decode(&ids, true).expect("decode"), "round trip ✓");
    }
}

#[test]
fn eos_ids_are_the_union_of_generation_config_and_tokenizer_eos() {
    let dir = scratch_dir("eos-union");
    std::os::unix::fs::symlink(
        assets_dir().join("llama3/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("symlink");
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}),
    );
    write_json(
        &dir.join("generation_config.json"),
        &json!({"eos_token_id": [128001, 128008]}),
    );
    write_json(
        &dir.join("config.json"),
        &json!({"eos_token_id": 7, "bos_token_id": 128000}),
    );
    let tok = TextTokenizer::from_dir(&dir, None).expect("load");
    assert_eq!(tok.eos_token_ids(), [128001, 128008, 128009]);
    assert_eq!(tok.bos_token_id(), Some(128000));
}

#[test]
fn config_json_supplies_eos_and_bos_when_nothing_else_does() {
    let dir = scratch_dir("eos-config");
    std::os::unix::fs::symlink(
        assets_dir().join("qwen2/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("symlink");
    write_json(
        &dir.join("config.json"),
        &json!({"eos_token_id": 151643, "bos_token_id": null}),
    );
    let tok = TextTokenizer::from_dir(&dir, None).expect("load");
    assert_eq!(tok.eos_token_ids(), [151643]);
    assert_eq!(tok.bos_token_id(), None);
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let dir = scratch_dir("no-tokenizer");
    let err = TextTokenizer::from_dir(&dir, None).expect_err("no tokenizer.json");
    assert!(matches!(err, TextError::LoadTokenizer { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn malformed_config_is_reported_with_its_path() {
    let dir = scratch_dir("bad-config");
    std::os::unix::fs::symlink(
        assets_dir().join("qwen2/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("symlink");
    std::fs::write(dir.join("generation_config.json"), "{not json").expect("write");
    let err = TextTokenizer::from_dir(&dir, None).expect_err("bad json");
    assert!(err.to_string().contains("generation_config.json"), "{err}");
}
