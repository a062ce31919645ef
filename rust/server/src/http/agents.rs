//! What the agent routes' handlers (`/v1/responses`, `/v1/messages`) share: the model their
//! request names (the base model or a LoRA adapter, resolved as on the chat route), the
//! checks' context, and the one choice started, then streamed or collected whole.

use super::error::ApiError;
use super::AppState;
use crate::generate::{self, Choices, Chunk, GenerationSpec};
use crate::validate::agents::ChatContext;
use tokenspeed_engine::scheduler::RequestId;

/// The model's facts the chat rules check a request against.
pub(super) fn chat_context(state: &AppState) -> ChatContext<'_> {
    ChatContext {
        defaults: &state.config.sampling_defaults,
        vocab_size: state.tokenizer.vocab_size() as u32,
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
