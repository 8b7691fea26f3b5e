//! Continuous-batching scheduler with chunked prefill.
