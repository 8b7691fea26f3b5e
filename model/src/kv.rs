//! Paged KV-cache block manager.
