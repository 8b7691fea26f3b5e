//! # holdfast-model: a DeepSeek-V4-shaped decoder and its model runner
//!
//! [`config`] reads and validates a Hugging Face-style `config.json`; [`kv`] is the paged KV
//! cache's block manager; [`scheduler`] turns a stream of requests into steps (continuous batching
//! with chunked prefill).

pub mod config;
pub mod kv;
pub mod scheduler;
