//! The pooling routes' fields (`/v1/embeddings`, `/v1/score`, `/v1/rerank`, `/classify`),
//! checked into what their adapters (`http/pooling.rs`) run.

use crate::error::RequestError;
use crate::generate::Prompt;
use crate::http::pooling::{
    ClassifyRequest, DocumentField, EmbeddingInput, EmbeddingRequest, RerankRequest, ScoreRequest,
    TextOrTexts,
};

/// What the served model's pooled vector is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingModel {
    /// An embedding (sentence-transformers, a decoder embedder).
    Embedding,
    /// A classifier's logits, one per label (a cross-encoder).
    Classifier { labels: usize },
}

impl PoolingModel {
    pub fn of(labels: &[String]) -> Self {
        if labels.is_empty() {
            PoolingModel::Embedding
        } else {
            PoolingModel::Classifier {
                labels: labels.len(),
            }
        }
    }
}

/// Whether a server of this kind (`--is-embedding` or not) runs `what` (a route, or an offline
/// request kind): a generating one pools nothing, a pooling one generates nothing.
pub fn check_server_kind(is_embedding: bool, pools: bool, what: &str) -> Result<(), RequestError> {
    match (is_embedding, pools) {
        (true, false) => Err(RequestError::bad_request(format!(
            "{what} generates text, but this server runs an embedding model (--is-embedding): \
             use /v1/embeddings, /v1/score, /v1/rerank or /classify"
        ))),
        (false, true) => Err(RequestError::bad_request(format!(
            "{what} needs an embedding or scoring model: start the server with --is-embedding"
        ))),
        _ => Ok(()),
    }
}

/// A `/v1/embeddings` request, checked.
#[derive(Debug)]
pub struct ValidatedEmbedding {
    pub prompts: Vec<Prompt>,
    /// `encoding_format: "base64"`: little-endian float32 bytes, base64 (else a float list).
    pub base64: bool,
    /// Matryoshka: keep the first this many dimensions (then scaled back to unit length).
    pub dimensions: Option<usize>,
}

pub fn embedding_request(
    req: &EmbeddingRequest,
    model: PoolingModel,
) -> Result<ValidatedEmbedding, RequestError> {
    if let PoolingModel::Classifier { .. } = model {
        return Err(RequestError::bad_request(
            "this model is a classifier (a cross-encoder): it gives scores, not embeddings; \
             use /v1/score, /v1/rerank or /classify",
        ));
    }
    let prompts: Vec<Prompt> = match req.input.clone() {
        EmbeddingInput::Text(t) => vec![Prompt::Text(t)],
        EmbeddingInput::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        EmbeddingInput::Ids(ids) => vec![Prompt::Ids(ids)],
        EmbeddingInput::IdBatches(v) => v.into_iter().map(Prompt::Ids).collect(),
    };
    if prompts.is_empty() {
        return Err(RequestError::bad_param("input", "the input list is empty"));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(RequestError::bad_param(
                "encoding_format",
                format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    let dimensions = match req.dimensions {
        Some(0) => {
            return Err(RequestError::bad_param(
                "dimensions",
                "dimensions must be at least 1",
            ))
        }
        d => d.map(|d| d as usize),
    };
    Ok(ValidatedEmbedding {
        prompts,
        base64,
        dimensions,
    })
}

/// `dimensions` against the model's embedding width (known once a vector came back).
pub fn check_dimensions(dimensions: Option<usize>, width: usize) -> Result<(), RequestError> {
    match dimensions {
        Some(d) if d > width => Err(RequestError::bad_param(
            "dimensions",
            format!("dimensions ({d}) exceeds the model's embedding size ({width})"),
        )),
        _ => Ok(()),
    }
}

/// Text pairs to score: one text against a list, or two lists of the same length (as vLLM).
pub fn score_pairs(
    text_1: &TextOrTexts,
    text_2: &TextOrTexts,
) -> Result<Vec<(String, String)>, RequestError> {
    let (a, b) = (text_1.clone().into_vec(), text_2.clone().into_vec());
    if a.is_empty() || b.is_empty() {
        return Err(RequestError::bad_request(
            "text_1 and text_2 must each hold at least one text",
        ));
    }
    if a.len() == 1 {
        return Ok(b.into_iter().map(|t| (a[0].clone(), t)).collect());
    }
    if a.len() != b.len() {
        return Err(RequestError::bad_param(
            "text_2",
            format!(
                "text_1 has {} texts and text_2 {}: give one text_1, or lists of the same length",
                a.len(),
                b.len()
            ),
        ));
    }
    Ok(a.into_iter().zip(b).collect())
}

/// A `/v1/score` request, checked.
pub fn score_request(
    req: &ScoreRequest,
    model: PoolingModel,
) -> Result<Vec<(String, String)>, RequestError> {
    check_scorer(model)?;
    score_pairs(&req.text_1, &req.text_2)
}

/// A `/v1/rerank` request, checked.
#[derive(Debug)]
pub struct ValidatedRerank {
    pub documents: Vec<String>,
    /// Results kept, best first (all when absent).
    pub top_n: usize,
    pub return_documents: bool,
}

pub fn rerank_request(
    req: &RerankRequest,
    model: PoolingModel,
) -> Result<ValidatedRerank, RequestError> {
    check_scorer(model)?;
    if req.documents.is_empty() {
        return Err(RequestError::bad_param(
            "documents",
            "the documents list is empty",
        ));
    }
    let documents: Vec<String> = req
        .documents
        .iter()
        .map(|d| match d {
            DocumentField::Text(t) => t.clone(),
            DocumentField::Object { text } => text.clone(),
        })
        .collect();
    let top_n = match req.top_n {
        Some(0) => return Err(RequestError::bad_param("top_n", "top_n must be at least 1")),
        Some(n) => (n as usize).min(documents.len()),
        None => documents.len(),
    };
    Ok(ValidatedRerank {
        documents,
        top_n,
        return_documents: req.return_documents.unwrap_or(true),
    })
}

/// Scores need one number per pair: an embedding model's cosine, or a one-label classifier.
fn check_scorer(model: PoolingModel) -> Result<(), RequestError> {
    match model {
        PoolingModel::Classifier { labels } if labels != 1 => {
            Err(RequestError::bad_request(format!(
                "this classifier has {labels} labels: scoring needs one relevance logit \
                 (a cross-encoder with num_labels 1); use /classify"
            )))
        }
        _ => Ok(()),
    }
}

/// A `/classify` request, checked: its texts.
pub fn classify_request(
    req: &ClassifyRequest,
    model: PoolingModel,
) -> Result<Vec<String>, RequestError> {
    if model == PoolingModel::Embedding {
        return Err(RequestError::bad_request(
            "this model is an embedding model, not a classifier: use /v1/embeddings",
        ));
    }
    let texts = req.input.clone().into_vec();
    if texts.is_empty() {
        return Err(RequestError::bad_param("input", "the input list is empty"));
    }
    Ok(texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(v: &[&str]) -> TextOrTexts {
        TextOrTexts::Many(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn score_pairs_one_against_many_or_zipped() {
        let one = TextOrTexts::One("q".into());
        let pairs = score_pairs(&one, &texts(&["a", "b"])).expect("1 x N");
        assert_eq!(pairs, [("q".into(), "a".into()), ("q".into(), "b".into())]);
        let zipped = score_pairs(&texts(&["x", "y"]), &texts(&["a", "b"])).expect("N x N");
        assert_eq!(zipped[1], ("y".into(), "b".into()));
        let err = score_pairs(&texts(&["x", "y"]), &texts(&["a", "b", "c"])).unwrap_err();
        assert_eq!(err.param(), Some("text_2"));
        assert!(score_pairs(&texts(&[]), &texts(&["a"])).is_err());
    }

    #[test]
    fn a_classifier_with_several_labels_does_not_score() {
        assert!(check_scorer(PoolingModel::Classifier { labels: 3 }).is_err());
        assert!(check_scorer(PoolingModel::Classifier { labels: 1 }).is_ok());
        assert!(check_scorer(PoolingModel::Embedding).is_ok());
    }

    #[test]
    fn dimensions_beyond_the_width_are_refused() {
        assert!(check_dimensions(Some(8), 4).is_err());
        assert!(check_dimensions(Some(4), 4).is_ok());
        assert!(check_dimensions(None, 4).is_ok());
    }
}
