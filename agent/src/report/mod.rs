//! Reporting to the picker(s): the shared per-pod state ([`hub`]) and one gRPC stream task per
//! picker ([`stream`]).

pub mod hub;
pub mod stream;
