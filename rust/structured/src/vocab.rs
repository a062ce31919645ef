//! The model's vocabulary as llguidance sees it: the bytes of every token id in a token trie, plus
//! a canonical tokenizer for the bytes a grammar forces.
//!
//! Adapted from `toktrie_hf_tokenizers` (MIT, guidance-ai/llguidance), which pins tokenizers 0.21;
//! this one works on the tokenizers 0.22 `Tokenizer` that `tokenspeed-text` has already loaded.

use crate::GrammarError;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokenizers::{
    normalizers, pre_tokenizers, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer,
};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// Byte-level BPE (GPT-2, Llama-3, Qwen) writes byte `b` as a printable char; this maps it back.
fn byte_level_char_map() -> HashMap<char, u8> {
    let self_mapped =
        |c: char| matches!(c, '!'..='~' | '\u{00A1}'..='\u{00AC}' | '\u{00AE}'..='\u{00FF}');
    let mut map = HashMap::new();
    let mut next = 0x100u32;
    for byte in 0..=255u8 {
        let c = byte as char;
        if self_mapped(c) {
            map.insert(c, byte);
        } else if let Some(shifted) = char::from_u32(next) {
            map.insert(shifted, byte);
            next += 1;
        }
    }
    map
}

/// How the tokenizer spells bytes in its vocabulary.
#[derive(Default)]
struct DecoderKind {
    byte_level: bool,
    byte_fallback: bool,
    /// The char sentencepiece vocabularies use for a space ('▁').
    space_char: Option<char>,
}

impl DecoderKind {
    fn inspect(decoder: &DecoderWrapper, kind: &mut DecoderKind) {
        match decoder {
            DecoderWrapper::ByteLevel(_) => kind.byte_level = true,
            DecoderWrapper::ByteFallback(_) => kind.byte_fallback = true,
            DecoderWrapper::Metaspace(m) => kind.space_char = Some(m.get_replacement()),
            DecoderWrapper::Replace(r) => {
                // `Replace`'s pattern is private; its serialized form names it.
                if let Ok(json) = serde_json::to_value(r) {
                    let pattern = json["pattern"]["String"].as_str().unwrap_or_default();
                    let mut chars = pattern.chars();
                    if let (Some(c), None, Some(" ")) =
                        (chars.next(), chars.next(), json["content"].as_str())
                    {
                        kind.space_char = Some(c);
                    }
                }
            }
            DecoderWrapper::Sequence(seq) => {
                for d in seq.get_decoders() {
                    Self::inspect(d, kind);
                }
            }
            _ => {}
        }
    }
}

/// Grammar-forced text must tokenize without the "prepend a space" sentencepiece habit: the
/// forced bytes continue the output, they do not start a sentence.
fn without_prepended_space(mut tokenizer: Tokenizer) -> Tokenizer {
    fn strip_prepend(n: NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = seq
                    .as_ref()
                    .iter()
                    .filter_map(|n| strip_prepend(n.clone()))
                    .collect();
                (!kept.is_empty())
                    .then(|| NormalizerWrapper::Sequence(normalizers::Sequence::new(kept)))
            }
            other => Some(other),
        }
    }
    fn never_prepend(pt: PreTokenizerWrapper) -> PreTokenizerWrapper {
        match pt {
            PreTokenizerWrapper::Metaspace(mut m) => {
                m.set_prepend_scheme(pre_tokenizers::metaspace::PrependScheme::Never);
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::Sequence(seq) => {
                PreTokenizerWrapper::Sequence(pre_tokenizers::sequence::Sequence::new(
                    seq.as_ref()
                        .iter()
                        .map(|pt| never_prepend(pt.clone()))
                        .collect(),
                ))
            }
            other => other,
        }
    }
    if let Some(n) = tokenizer.get_normalizer().cloned() {
        tokenizer.with_normalizer(strip_prepend(n));
    }
    if let Some(pt) = tokenizer.get_pre_tokenizer().cloned() {
        tokenizer.with_pre_tokenizer(Some(never_prepend(pt)));
    }
    tokenizer
}

/// The bytes of every id below `model_vocab_size`. Special tokens get llguidance's marker byte
/// (so grammars can name them as `<|python_tag|>` but free text never produces them); ids past
/// the tokenizer (a model's padded embedding rows) become unreachable special tokens.
fn token_bytes(
    tokenizer: &Tokenizer,
    model_vocab_size: usize,
) -> Result<Vec<Vec<u8>>, GrammarError> {
    let mut kind = DecoderKind::default();
    if let Some(d) = tokenizer.get_decoder() {
        DecoderKind::inspect(d, &mut kind);
    }
    if !kind.byte_level && !kind.byte_fallback {
        return Err(GrammarError::Tokenizer(format!(
            "cannot map tokens to bytes: the decoder is neither ByteLevel nor ByteFallback ({:?})",
            tokenizer.get_decoder()
        )));
    }
    let tokenizer_vocab = tokenizer.get_vocab_size(true);
    if model_vocab_size < tokenizer_vocab {
        return Err(GrammarError::Tokenizer(format!(
            "the model's vocab size {model_vocab_size} is smaller than the tokenizer's {tokenizer_vocab}"
        )));
    }
    let special_bytes = |name: &str| {
        let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        bytes.extend_from_slice(name.as_bytes());
        bytes
    };
    let mut bytes: Vec<Vec<u8>> = vec![Vec::new(); model_vocab_size];
    let mut specials = HashSet::new();
    for (id, added) in tokenizer.get_added_tokens_decoder() {
        let Some(slot) = bytes.get_mut(id as usize) else {
            continue;
        };
        // As llguidance does: any added `<...>` token is a control token, not text.
        if added.special || (added.content.starts_with('<') && added.content.ends_with('>')) {
            *slot = special_bytes(&added.content);
            specials.insert(id);
        } else {
            *slot = added.content.into_bytes();
        }
    }
    let char_map = byte_level_char_map();
    let space_char = kind.space_char.unwrap_or(' ');
    for id in 0..tokenizer_vocab as u32 {
        if specials.contains(&id) {
            continue;
        }
        let Some(name) = tokenizer.id_to_token(id) else {
            continue;
        };
        let slot = &mut bytes[id as usize];
        if !slot.is_empty() {
            continue; // a non-special added token, already its content
        }
        if kind.byte_fallback {
            let hex = name
                .strip_prefix("<0x")
                .and_then(|rest| rest.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            *slot = match hex {
                Some(byte) => vec![byte],
                None => name.replace(space_char, " ").into_bytes(),
            };
        } else {
            // A byte-level name with a char outside the map is not a real token: leave it empty,
            // which the trie never allows.
            if let Some(b) = name
                .chars()
                .map(|c| char_map.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
            {
                *slot = b;
            }
        }
    }
    for (id, slot) in bytes.iter_mut().enumerate().skip(tokenizer_vocab) {
        *slot = special_bytes(&format!("<[{id}]>"));
    }
    Ok(bytes)
}

/// llguidance's view of the tokenizer: the trie and a canonical tokenizer.
struct HfTokenizerEnv {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for HfTokenizerEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                // Encoding plain text does not fail in practice; greedy is a safe stand-in.
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// Builds llguidance's `TokEnv` for a model whose embedding has `model_vocab_size` rows and which
/// stops on `eos_ids` (the first is the primary one).
pub(crate) fn tok_env(
    tokenizer: &Tokenizer,
    model_vocab_size: usize,
    eos_ids: &[u32],
) -> Result<TokEnv, GrammarError> {
    let bytes = token_bytes(tokenizer, model_vocab_size)?;
    let Some(&primary_eos) = eos_ids.first() else {
        return Err(GrammarError::Tokenizer(
            "the model has no eos token id: a grammar could never end generation".into(),
        ));
    };
    if let Some(&bad) = eos_ids.iter().find(|&&id| id as usize >= model_vocab_size) {
        return Err(GrammarError::Tokenizer(format!(
            "eos token id {bad} is outside the model's vocab of {model_vocab_size}"
        )));
    }
    let info = TokRxInfo::new(model_vocab_size as u32, primary_eos);
    let mut trie = TokTrie::from(&info, &bytes);
    if eos_ids.len() > 1 {
        trie = trie.with_eos_tokens(eos_ids);
    }
    Ok(Arc::new(HfTokenizerEnv {
        tokenizer: without_prepended_space(tokenizer.clone()),
        trie,
    }))
}
