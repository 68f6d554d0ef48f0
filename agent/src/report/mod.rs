//! Reporting to the picker(s): the shared per-pod state ([`hub`]), the KV-event reader's way into
//! it ([`sink`]) and one gRPC stream task per picker ([`stream`]).

pub mod hub;
pub(crate) mod sink;
pub mod stream;
