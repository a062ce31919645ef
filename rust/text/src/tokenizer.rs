//! `TextTokenizer`: an HF model directory's tokenizer, special tokens, eos ids and chat template.

use crate::chat::ChatTemplate;
use crate::TextError;
use serde_json::{Map, Value as Json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Special tokens of `tokenizer_config.json` exposed to chat templates, as HF does.
const TEMPLATE_SPECIAL_TOKENS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// A loaded tokenizer; immutable and shareable across threads.
#[derive(Debug)]
pub struct TextTokenizer {
    tokenizer: Tokenizer,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    chat_template: Option<ChatTemplate>,
    /// `Tokenizer::get_vocab_size(true)` clones the whole vocabulary map (128k strings for
    /// Llama 3: tens of milliseconds), and every request's validation asks for it: counted once.
    vocab_size: usize,
    /// Added tokens (special or not) by id, with their raw text: what
    /// `spaces_between_special_tokens=false` joins without the decoder's separator. Built once,
    /// as `get_added_tokens_decoder` builds a fresh map on every call.
    added_tokens: HashMap<u32, String>,
}

impl TextTokenizer {
    /// Loads `tokenizer.json` plus the optional `tokenizer_config.json`, `chat_template.jinja`,
    /// `generation_config.json` and `config.json` of an HF model directory.
    ///
    /// `chat_template_override` is a path to a Jinja file or an inline template; it replaces the
    /// model's own template.
    pub fn from_dir(dir: &Path, chat_template_override: Option<&str>) -> Result<Self, TextError> {
        let tokenizer = load_tokenizer_json(dir)?;
        let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let special = SpecialTokens::read(dir, &tokenizer, &tokenizer_config)?;
        let templates = match chat_template_override {
            Some(spec) => vec![(String::from("default"), read_template_override(spec)?)],
            None => model_templates(dir, &tokenizer_config)?,
        };
        let chat_template = if templates.is_empty() {
            None
        } else {
            Some(ChatTemplate::new(templates, special.texts)?)
        };

        let added_tokens = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (id, token.content))
            .collect();
        Ok(Self {
            vocab_size: tokenizer.get_vocab_size(true),
            added_tokens,
            tokenizer,
            eos_token_ids: special.eos_token_ids,
            bos_token_id: special.bos_token_id,
            chat_template,
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`; ids outside the vocabulary are skipped, as in HF.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Decode(e.to_string()))
    }

    /// The HF tokenizer itself, for crates that build on its vocabulary (the grammar engine's
    /// token trie in `tokenspeed-structured`).
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids that end generation: generation_config (or config) `eos_token_id` plus the tokenizer's
    /// `eos_token`, without duplicates.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The raw text of `id` if it is an added token (special or not), e.g. `<|im_end|>`.
    pub fn added_token(&self, id: u32) -> Option<&str> {
        self.added_tokens.get(&id).map(String::as_str)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// Whether a chat template is available (the model's own or an override).
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders an OpenAI `messages` array to the prompt text. `extra` is a JSON object whose keys
    /// become template variables (`tools`, `documents`, template kwargs).
    pub fn apply_chat_template(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String, TextError> {
        self.chat_template
            .as_ref()
            .ok_or(TextError::NoChatTemplate)?
            .render(messages, add_generation_prompt, extra)
    }

    /// Prompt ids of a chat. The template writes any BOS itself, so the rendered text is encoded
    /// without special tokens: adding them again would give a double BOS.
    pub fn encode_chat(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TextError> {
        let text = self.apply_chat_template(messages, add_generation_prompt, None)?;
        self.encode(&text, false)
    }
}

/// Parses a JSON file; `Ok(None)` when it does not exist.
/// `tokenizer.json` of an HF model directory (only fast tokenizers are supported), unpadded.
fn load_tokenizer_json(dir: &Path) -> Result<Tokenizer, TextError> {
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        return Err(TextError::LoadTokenizer {
            path: tokenizer_path,
            message: "file not found (only HF fast tokenizers, tokenizer.json, are supported)"
                .into(),
        });
    }
    let mut tokenizer =
        Tokenizer::from_file(&tokenizer_path).map_err(|e| TextError::LoadTokenizer {
            path: tokenizer_path.clone(),
            message: e.to_string(),
        })?;
    // A prompt is never padded: a tokenizer.json saved with fixed-length padding (BERT
    // sentence-transformers checkpoints: 128 [PAD]s) would feed the pads to the model.
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

/// The special tokens a chat template may reference (`bos_token`, `eos_token`, ...) and the
/// ids generation stops on or starts with.
struct SpecialTokens {
    texts: Map<String, Json>,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
}

impl SpecialTokens {
    fn read(dir: &Path, tokenizer: &Tokenizer, tokenizer_config: &Json) -> Result<Self, TextError> {
        let generation_config = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
        let model_config = read_json(&dir.join("config.json"))?.unwrap_or_default();

        // generation_config.json is what `generate()` stops on; config.json is the older home.
        let config_value = |key: &str| {
            generation_config
                .get(key)
                .filter(|v| !v.is_null())
                .or_else(|| model_config.get(key).filter(|v| !v.is_null()))
        };
        let mut special_tokens = Map::new();
        for key in TEMPLATE_SPECIAL_TOKENS {
            if let Some(text) = special_token_text(tokenizer_config.get(key)) {
                special_tokens.insert(key.into(), Json::String(text));
            }
        }
        let token_id = |key: &str| {
            special_tokens
                .get(key)
                .and_then(Json::as_str)
                .and_then(|t| tokenizer.token_to_id(t))
        };

        let mut eos_token_ids = config_value("eos_token_id")
            .map(token_ids)
            .unwrap_or_default();
        if let Some(id) = token_id("eos_token") {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let bos_token_id = token_id("bos_token").or_else(|| {
            config_value("bos_token_id")
                .map(token_ids)
                .and_then(|ids| ids.first().copied())
        });
        // Templates reference `bos_token`/`eos_token` even when only the config names the ids.
        for (key, id) in [
            ("bos_token", bos_token_id),
            ("eos_token", eos_token_ids.first().copied()),
        ] {
            if let (false, Some(text)) = (
                special_tokens.contains_key(key),
                id.and_then(|id| tokenizer.id_to_token(id)),
            ) {
                special_tokens.insert(key.into(), Json::String(text));
            }
        }
        Ok(SpecialTokens {
            texts: special_tokens,
            eos_token_ids,
            bos_token_id,
        })
    }
}

fn read_json(path: &Path) -> Result<Option<Json>, TextError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TextError::Config {
            path: path.to_owned(),
            message: e.to_string(),
        })
}

/// A special token is written either as a string or as an AddedToken object `{"content": ...}`.
fn special_token_text(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` is an int or a list of ints.
fn token_ids(value: &Json) -> Vec<u32> {
    let as_id = |v: &Json| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match value {
        Json::Array(items) => items.iter().filter_map(as_id).collect(),
        other => as_id(other).into_iter().collect(),
    }
}

/// An override is a path to a file or, when it looks like Jinja, the template itself.
fn read_template_override(spec: &str) -> Result<String, TextError> {
    let path = Path::new(spec);
    if path.is_file() {
        return std::fs::read_to_string(path).map_err(|source| TextError::Io {
            path: path.to_owned(),
            source,
        });
    }
    if spec.contains("{{") || spec.contains("{%") {
        return Ok(spec.to_owned());
    }
    Err(TextError::ChatTemplateNotFound(PathBuf::from(spec)))
}

/// The model's templates: `chat_template.jinja` (the newer home) wins over the
/// `tokenizer_config.json` entry, which is a string or a list of `{name, template}`.
fn model_templates(
    dir: &Path,
    tokenizer_config: &Json,
) -> Result<Vec<(String, String)>, TextError> {
    let jinja_path = dir.join("chat_template.jinja");
    if jinja_path.is_file() {
        let source = std::fs::read_to_string(&jinja_path).map_err(|source| TextError::Io {
            path: jinja_path,
            source,
        })?;
        return Ok(vec![("default".into(), source)]);
    }
    let config_path = || dir.join("tokenizer_config.json");
    match tokenizer_config.get("chat_template") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(s)) => Ok(vec![("default".into(), s.clone())]),
        Some(Json::Array(items)) => items
            .iter()
            .map(|item| {
                let field = |k: &str| item.get(k).and_then(Json::as_str).map(str::to_owned);
                match (field("name"), field("template")) {
                    (Some(name), Some(template)) => Ok((name, template)),
                    _ => Err(TextError::Config {
                        path: config_path(),
                        message: "chat_template list entries need string `name` and `template`"
                            .into(),
                    }),
                }
            })
            .collect(),
        Some(_) => Err(TextError::Config {
            path: config_path(),
            message: "chat_template must be a string or a list of {name, template}".into(),
        }),
    }
}
