//! Encoding of plans and results into slot payloads: everything comes from the declared schema
//! (`tokenspeed_engine::plan`, machinery in `tokenspeed_engine::schema`); this module only maps
//! its errors to the channel's.

use tokenspeed_engine::schema::{Message, SchemaError};

pub use tokenspeed_engine::schema::{ArrayDesc, DType, Layout};

use crate::IpcError;

impl From<SchemaError> for IpcError {
    fn from(e: SchemaError) -> Self {
        match e {
            SchemaError::TooLarge { need, cap } => IpcError::TooLarge { need, cap },
            SchemaError::Corrupt(m) => IpcError::Corrupt(m),
            SchemaError::BadArrays(m) => IpcError::BadResult(m),
        }
    }
}

pub fn encode<M: Message>(m: &M, buf: &mut [u8]) -> Result<usize, IpcError> {
    Ok(m.encode(buf)?)
}

pub fn decode<M: Message>(buf: &[u8]) -> Result<M, IpcError> {
    Ok(M::decode(buf)?)
}

pub fn layout_of<M: Message>(buf: &[u8]) -> Result<Layout, IpcError> {
    Ok(M::layout_of(buf)?)
}

/// Encodes a message given as raw little-endian arrays by name (see `Message::encode_arrays`).
pub fn encode_arrays<'a, M: Message>(
    step_id: u64,
    get: impl Fn(&str) -> Option<&'a [u8]>,
    buf: &mut [u8],
) -> Result<usize, IpcError> {
    Ok(M::encode_arrays(step_id, get, buf)?)
}
