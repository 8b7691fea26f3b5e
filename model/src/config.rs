//! Model configuration.
