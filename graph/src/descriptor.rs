//! The graph cache key (spec §3.1).

use std::fmt;

/// Identifies one captured graph: the padded shape of a step. Equality and hashing cover every
/// field, so two steps share a graph exactly when their descriptors are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchDescriptor {
    /// Token count of the step, in tokens (padded, except for eager steps).
    pub num_tokens: u32,
    /// Request count the graph was captured for; `None` for piecewise keys, which serve any
    /// request count.
    pub num_reqs: Option<u32>,
    /// Every request has the uniform decode query length (`1 + num_spec_tokens`).
    pub uniform: bool,
    /// Some request uses a LoRA adapter.
    pub has_lora: bool,
    /// Distinct active LoRA adapters the graph was captured for (the grid size of some LoRA
    /// kernels); 0 without LoRA.
    pub num_active_loras: u32,
}

impl BatchDescriptor {
    /// The descriptor of an eager step: `num_tokens` as given, nothing else.
    pub const fn unpadded(num_tokens: u32) -> BatchDescriptor {
        BatchDescriptor { num_tokens, num_reqs: None, uniform: false, has_lora: false, num_active_loras: 0 }
    }

    /// The same descriptor without the request count and uniform flag: the key under which a
    /// piecewise graph serves it.
    #[must_use]
    pub const fn relaxed(self) -> BatchDescriptor {
        BatchDescriptor { num_reqs: None, uniform: false, ..self }
    }
}

impl fmt::Display for BatchDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{num_tokens={}, num_reqs=", self.num_tokens)?;
        match self.num_reqs {
            Some(r) => write!(f, "{r}")?,
            None => f.write_str("any")?,
        }
        write!(
            f,
            ", uniform={}, has_lora={}, num_active_loras={}}}",
            self.uniform, self.has_lora, self.num_active_loras
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpadded_has_only_the_token_count() {
        let d = BatchDescriptor::unpadded(7);
        assert_eq!(
            d,
            BatchDescriptor { num_tokens: 7, num_reqs: None, uniform: false, has_lora: false, num_active_loras: 0 }
        );
    }

    #[test]
    fn relaxing_drops_request_count_and_uniformity_only() {
        let d =
            BatchDescriptor { num_tokens: 8, num_reqs: Some(4), uniform: true, has_lora: true, num_active_loras: 2 };
        let r = d.relaxed();
        assert_eq!((r.num_tokens, r.num_reqs, r.uniform, r.has_lora, r.num_active_loras), (8, None, false, true, 2));
    }

    #[test]
    fn display_names_every_field() {
        let d =
            BatchDescriptor { num_tokens: 8, num_reqs: Some(4), uniform: true, has_lora: false, num_active_loras: 0 };
        assert_eq!(d.to_string(), "{num_tokens=8, num_reqs=4, uniform=true, has_lora=false, num_active_loras=0}");
        assert!(BatchDescriptor::unpadded(3).to_string().contains("num_reqs=any"));
    }
}
