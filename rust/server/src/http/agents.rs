//! What the agent routes' handlers (`/v1/responses`, `/v1/messages`) share: the model their
//! request names (the base model or a LoRA adapter, resolved as on the chat route), the
//! checks' context, and the one choice started, then streamed or collected whole.

use std::sync::Arc;

use super::chat::strip_special_stop;
use super::error::ApiError;
use super::AppState;
use crate::chat_output::OutputStage;
use crate::generate::{self, Choices, Chunk, GenerationSpec};
use crate::validate::agents::ChatContext;
use crate::validate::chat::ValidatedChat;
use tokenspeed_engine::scheduler::RequestId;
use tokenspeed_text::TextTokenizer;

/// A unique id of an output item or block, `<prefix>_<uuid>`.
pub(super) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// How a chunk's text becomes the answer: a special stop token's text cut, then the output
/// stage's split (reasoning, text, tool calls).
pub(super) struct Answer {
    pub stage: OutputStage,
    keep_special: bool,
    pub tokenizer: Arc<TextTokenizer>,
}

impl Answer {
    pub fn new(state: &AppState, checked: &ValidatedChat) -> Self {
        Self {
            stage: checked.stage.clone(),
            keep_special: checked.keep_special,
            tokenizer: state.tokenizer.clone(),
        }
    }

    pub fn text(&self, c: &Chunk) -> String {
        let mut text = c.text.clone();
        strip_special_stop(&self.tokenizer, self.keep_special, &mut text, c);
        text
    }
}

/// The model's facts the chat rules check a request against.
pub(super) fn chat_context(state: &AppState) -> ChatContext<'_> {
    ChatContext {
        defaults: &state.config.sampling_defaults,
        vocab_size: state.tokenizer.vocab_size() as u32,
        max_logprobs: state.config.max_logprobs,
        parsers: &state.chat_parsers,
    }
}

/// The generation's output: its choice as it comes, or whole.
pub(super) enum Output {
    Stream(Choices),
    Whole(Chunk),
}

/// A started agent request.
pub(super) struct Started {
    pub rid: RequestId,
    /// The model the answer names: the adapter it ran on, else the served model.
    pub model: String,
    pub output: Output,
}

/// The adapter a request runs on (None: the base model).
pub(super) struct Agent {
    adapter: Option<crate::lora::Adapter>,
}

impl Agent {
    /// What `model` names: 404 for an unknown name, as on the chat route (resolved before
    /// validating, so that error comes first there too).
    pub fn resolve(state: &AppState, model: Option<&str>) -> Result<Self, ApiError> {
        Ok(Self {
            adapter: state.adapter_for(model, None)?,
        })
    }

    /// Starts `spec` on the adapter and, unless `stream`, collects its one choice.
    pub async fn run(
        self,
        state: &AppState,
        mut spec: GenerationSpec,
        stream: bool,
    ) -> Result<Started, ApiError> {
        let model = self.adapter.as_ref().map_or_else(
            || state.config.served_model_name.clone(),
            |a| a.name.clone(),
        );
        crate::lora::run_on(&mut spec.sampling, self.adapter);
        let rid = generate::new_request_id();
        let choices = generate::start_choices(state, rid, vec![spec], 1).await?;
        let output = if stream {
            Output::Stream(choices)
        } else {
            let chunk = choices
                .collect()
                .await?
                .into_iter()
                .next()
                .ok_or_else(|| ApiError::internal("the request ended without output"))?;
            Output::Whole(chunk)
        };
        Ok(Started { rid, model, output })
    }
}
