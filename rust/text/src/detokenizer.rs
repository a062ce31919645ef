//! Incremental detokenizing: turns a stream of token ids into text deltas without splitting a character.

use crate::{TextError, TextTokenizer};

const REPLACEMENT: char = '\u{FFFD}';

/// Per-request streaming decoder (the prefix_offset/read_offset algorithm of TGI and vLLM).
///
/// Each step decodes two windows that start at the same token, `ids[prefix_offset..read_offset]`
/// (text already emitted) and `ids[prefix_offset..]`, and emits the difference. Starting both at
/// the same token makes decoder context (sentencepiece's stripped leading space, byte-level
/// merges) identical on both sides. A window ending in U+FFFD is an unfinished UTF-8 character
/// (byte-level or byte-fallback tokens) and is held back until a later token completes it.
///
/// `spaces_between_special_tokens(false)` (vLLM's sampling parameter) gives an added token that
/// directly follows another added token its raw text, without the separator some decoders put
/// between tokens (WordPiece, or no decoder at all: `[SEP] [SEP]` becomes `[SEP][SEP]`). Like
/// vLLM's fast detokenizer, it only matters with `skip_special_tokens=false`, and a token after
/// the prompt never counts as following one. Byte-level BPE tokenizers (Llama 3, Qwen, SmolLM)
/// put no separator there, so their text is the same either way.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    skip_special_tokens: bool,
    /// Adjacent added tokens are joined without a separator (`spaces_between_special_tokens`
    /// off while special tokens are kept).
    join_added_tokens: bool,
    /// Whether the last pushed token was an added token.
    last_added: bool,
    /// The last few prompt tokens, then every pushed token.
    ids: Vec<u32>,
    /// How many of `ids` are prompt context (never emitted).
    context_len: usize,
    prefix_offset: usize,
    read_offset: usize,
}

/// Prompt tokens kept as decoding context: enough for any merge or space rule to see the word
/// the output continues (vLLM keeps 5).
const CONTEXT_TOKENS: usize = 6;

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self::with_prompt(skip_special_tokens, &[])
    }

    /// A decoder for the continuation of `prompt`: its last tokens are decoding context, so a
    /// sentencepiece tokenizer keeps the space that starts the first generated word (decoded
    /// alone, a leading "▁word" loses it).
    pub fn with_prompt(skip_special_tokens: bool, prompt: &[u32]) -> Self {
        let context = &prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..];
        Self {
            skip_special_tokens,
            join_added_tokens: false,
            last_added: false,
            ids: context.to_vec(),
            context_len: context.len(),
            prefix_offset: 0,
            read_offset: context.len(),
        }
    }

    /// vLLM's `spaces_between_special_tokens` (on by default); ignored when special tokens are
    /// skipped, as in vLLM.
    pub fn spaces_between_special_tokens(mut self, on: bool) -> Self {
        self.join_added_tokens = !on && !self.skip_special_tokens;
        self
    }

    /// All token ids pushed so far (the prompt context excluded).
    pub fn ids(&self) -> &[u32] {
        &self.ids[self.context_len..]
    }

    /// Adds one generated token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        if !self.join_added_tokens {
            return self.emit(tok, false);
        }
        let added = tok.added_token(id);
        let follows_added = std::mem::replace(&mut self.last_added, added.is_some());
        match added {
            Some(raw) if follows_added => {
                // The previous added token flushed everything before it, so only this token is
                // pending: emit it (advancing the offsets) and send its raw text instead.
                self.emit(tok, true)?;
                Ok(raw.to_owned())
            }
            _ => self.emit(tok, false),
        }
    }

    /// Flushes held-back text at the end of the stream, even an unfinished character.
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, TextError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        self.emit(tok, true)
    }

    fn emit(&mut self, tok: &TextTokenizer, flush: bool) -> Result<String, TextError> {
        let skip = self.skip_special_tokens;
        let prefix_text = tok.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let new_text = tok.decode(&self.ids[self.prefix_offset..], skip)?;
        let complete = !new_text.ends_with(REPLACEMENT);
        if !flush && (new_text.len() <= prefix_text.len() || !complete) {
            return Ok(String::new());
        }
        let delta = suffix_after(&new_text, &prefix_text).to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }
}

/// The part of `new_text` after `prefix_text`. Normally `prefix_text` is a prefix; if a decoder
/// rewrote earlier text (an invalid byte sequence turned into U+FFFD), fall back to the part after
/// the longest common prefix so we never panic on a char boundary.
fn suffix_after<'a>(new_text: &'a str, prefix_text: &str) -> &'a str {
    if let Some(rest) = new_text.strip_prefix(prefix_text) {
        return rest;
    }
    let common = new_text
        .char_indices()
        .zip(prefix_text.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| prefix_text.len().min(new_text.len()));
    new_text.get(common..).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::suffix_after;

    #[test]
    fn suffix_after_strips_a_true_prefix() {
        assert_eq!(suffix_after("hello world", "hello"), " world");
    }

    #[test]
    fn suffix_after_survives_rewritten_prefix() {
        assert_eq!(suffix_after("中\u{FFFD}x", "中文"), "\u{FFFD}x");
        assert_eq!(suffix_after("ab", "abc"), "");
    }
}
