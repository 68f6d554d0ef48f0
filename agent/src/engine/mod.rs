//! Everything about one vLLM engine: its `/metrics` page, its KV-event stream, the agent's record
//! of its blocks, and the tasks that scrape and subscribe.

pub mod blocks;
pub mod kv_events;
pub mod metrics;
pub mod scrape;
pub mod subscriber;
