//! Chat templates render exactly as HF `apply_chat_template`, and chat prompts carry one BOS.

mod common;

use common::{assets_dir, scratch_dir, write_json, SMOLLM2, SPM_LEGACY};
use serde_json::{json, Value};
use std::path::PathBuf;
use tokenspeed_text::{TextError, TextTokenizer};

const SMOL_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

fn template_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/templates")
        .join(name)
}

fn expected(name: &str) -> String {
    let path = template_file(&format!("{name}.expected.txt"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city — «now»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}])
}

fn smollm2_with_template(template: &str) -> TextTokenizer {
    let path = template_file(template);
    let spec = path.to_str().expect("utf-8 path");
    TextTokenizer::from_dir(&assets_dir().join("smollm2"), Some(spec)).expect("load")
}

#[test]
fn smollm2_template_matches_hf_with_default_system_prompt() {
    let messages = json!([{"role": "user", "content": "Hello!"}]);
    let user = "<|im_start|>user\nHello!<|im_end|>\n";
    let with_prompt = SMOLLM2
        .apply_chat_template(&messages, true, None)
        .expect("render");
    assert_eq!(
        with_prompt,
        format!("{SMOL_SYSTEM}{user}<|im_start|>assistant\n")
    );
    let without = SMOLLM2
        .apply_chat_template(&messages, false, None)
        .expect("render");
    assert_eq!(without, format!("{SMOL_SYSTEM}{user}"));
}

#[test]
fn smollm2_multi_turn_matches_hf_text_and_ids() {
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 🙂\nThanks"},
    ]);
    let text = SMOLLM2
        .apply_chat_template(&messages, true, None)
        .expect("render");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3? 你好 🙂\nThanks<|im_end|>\n<|im_start|>assistant\n"
    );
    // HF: apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    let hf_ids: [u32; 49] = [
        1, 9690, 198, 2683, 359, 1733, 313, 30, 2, 198, 1, 4093, 198, 34, 27, 34, 47, 2, 198, 1,
        520, 9531, 198, 36, 2, 198, 1, 4093, 198, 3528, 216, 35, 27, 35, 47, 216, 18645, 250,
        48392, 138, 47526, 198, 16937, 2, 198, 1, 520, 9531, 198,
    ];
    let ids = SMOLLM2.encode_chat(&messages, true).expect("encode");
    assert_eq!(ids, hf_ids);
}

#[test]
fn content_parts_render_like_plain_strings() {
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]);
    let plain = json!([{"role": "user", "content": "Hello!"}]);
    assert_eq!(
        SMOLLM2
            .apply_chat_template(&parts, true, None)
            .expect("parts"),
        SMOLLM2
            .apply_chat_template(&plain, true, None)
            .expect("plain"),
    );
}

#[test]
fn tool_calling_template_matches_hf() {
    let tok = smollm2_with_template("qwen25_tools.jinja");
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What's the weather in Paris & 東京?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "sunny"},
    ]);
    let extra = json!({"tools": tools()});
    for (gen, name) in [(true, "qwen25_tools.gen"), (false, "qwen25_tools.nogen")] {
        let text = tok
            .apply_chat_template(&messages, gen, Some(&extra))
            .expect("render");
        assert_eq!(text, expected(name), "{name}");
    }
    let first_two = json!(messages.as_array().expect("array")[..2]);
    let text = tok
        .apply_chat_template(&first_two, true, None)
        .expect("render");
    assert_eq!(text, expected("qwen25_notools.gen"));
}

#[test]
fn python_isms_in_templates_match_hf() {
    let tok = smollm2_with_template("pycompat.jinja");
    let messages = json!([
        {"role": "user", "content": "Hi there \n"},
        {"role": "assistant", "content": "hello\nworld"},
        {"role": "user", "content": "  hI again  "},
    ]);
    let extra = json!({"tools": tools()});
    for (gen, name) in [(true, "pycompat.gen"), (false, "pycompat.nogen")] {
        let text = tok
            .apply_chat_template(&messages, gen, Some(&extra))
            .expect("render");
        assert_eq!(text, expected(name), "{name}");
    }
}

#[test]
fn template_exceptions_become_render_errors() {
    let tok = smollm2_with_template("pycompat.jinja");
    let messages = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
    let extra = json!({"tools": tools()});
    let err = tok
        .apply_chat_template(&messages, true, Some(&extra))
        .expect_err("odd user");
    assert!(
        matches!(err, TextError::Render(ref m) if m == "odd user"),
        "{err}"
    );
}

#[test]
fn missing_template_is_a_clear_error() {
    let tok = TextTokenizer::from_dir(&assets_dir().join("llama3"), None).expect("load");
    assert!(!tok.has_chat_template());
    let err = tok
        .apply_chat_template(&json!([]), true, None)
        .expect_err("no template");
    assert!(matches!(err, TextError::NoChatTemplate));
    assert!(err.to_string().contains("--chat-template"), "{err}");
}

#[test]
fn inline_override_replaces_the_model_template() {
    let dir = assets_dir().join("smollm2");
    let tok = TextTokenizer::from_dir(
        &dir,
        Some("{% for m in messages %}{{ m.content }}|{% endfor %}"),
    )
    .expect("load");
    let text = tok
        .apply_chat_template(&json!([{"role": "user", "content": "x"}]), true, None)
        .expect("render");
    assert_eq!(text, "x|");
}

#[test]
fn override_naming_a_missing_file_fails_at_load() {
    let err = TextTokenizer::from_dir(
        &assets_dir().join("smollm2"),
        Some("/no/such/template.jinja"),
    )
    .expect_err("missing file");
    assert!(matches!(err, TextError::ChatTemplateNotFound(_)), "{err}");
}

#[test]
fn named_templates_in_tokenizer_config_are_selected_by_tools() {
    let dir = scratch_dir("named-templates");
    std::os::unix::fs::symlink(
        assets_dir().join("qwen2/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("symlink");
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"eos_token": "<|im_end|>", "chat_template": [
            {"name": "default", "template": "plain:{{ messages | length }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"}]}),
    );
    let tok = TextTokenizer::from_dir(&dir, None).expect("load");
    let extra = json!({"tools": tools()});
    assert_eq!(
        tok.apply_chat_template(&json!([]), true, None).expect("r"),
        "plain:0"
    );
    assert_eq!(
        tok.apply_chat_template(&json!([]), true, Some(&extra))
            .expect("r"),
        "tools:1"
    );
}

#[test]
fn chat_prompt_has_exactly_one_bos_with_sentencepiece_tokenizer() {
    let tok = &*SPM_LEGACY;
    let bos = tok.bos_token_id().expect("bos");
    let messages = json!([{"role": "user", "content": "Hello world"}]);
    let ids = tok.encode_chat(&messages, true).expect("encode");
    assert_eq!(ids[0], bos);
    assert_eq!(ids.iter().filter(|&&id| id == bos).count(), 1, "{ids:?}");
    // The trap this guards against: re-adding special tokens to text that already starts with BOS.
    let text = tok
        .apply_chat_template(&messages, true, None)
        .expect("render");
    let doubled = tok.encode(&text, true).expect("encode");
    assert_eq!(&doubled[..2], [bos, bos]);
}

#[test]
fn chat_prompt_has_exactly_one_bos_with_llama3_tokenizer() {
    let dir = scratch_dir("llama3-chat");
    std::os::unix::fs::symlink(
        assets_dir().join("llama3/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("symlink");
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
            "chat_template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"}),
    );
    let tok = TextTokenizer::from_dir(&dir, None).expect("load");
    let bos = tok.bos_token_id().expect("bos");
    assert_eq!(Some(bos), tok.token_to_id("<|begin_of_text|>"));
    let ids = tok
        .encode_chat(&json!([{"role": "user", "content": "Hi"}]), true)
        .expect("encode");
    assert_eq!(ids[0], bos);
    assert_eq!(ids.iter().filter(|&&id| id == bos).count(), 1, "{ids:?}");
}
