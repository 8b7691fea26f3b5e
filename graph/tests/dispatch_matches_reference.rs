//! `Dispatcher` against a plain model written straight from the spec (§3.3): linear-scan
//! padding, keys in `Vec`s, modes as the reference's int-or-pair values, and a failed assertion
//! as `Err(())`. Random sizes, request limits, query lengths, LoRA configs, all five modes and
//! random valid/invalid mode sets.

use holdfast_graph::{
    BatchDescriptor, CaptureSizes, Dispatcher, DispatcherConfig, GraphMode, LoraConfig, ModeSet, RuntimeMode,
};
use proptest::prelude::*;

/// The reference's value encoding: an int (0 NONE, 1 PIECEWISE, 2 FULL) or a (decode, mixed)
/// pair.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Value {
    Int(u8),
    Pair(u8, u8),
}

fn value(m: GraphMode) -> Value {
    match m {
        GraphMode::None => Value::Int(0),
        GraphMode::Piecewise => Value::Int(1),
        GraphMode::Full => Value::Int(2),
        GraphMode::FullDecodeOnly => Value::Pair(2, 0),
        GraphMode::FullAndPiecewise => Value::Pair(2, 1),
    }
}

fn runtime(i: u8) -> RuntimeMode {
    match i {
        0 => RuntimeMode::None,
        1 => RuntimeMode::Piecewise,
        _ => RuntimeMode::Full,
    }
}

fn decode_of(v: Value) -> u8 {
    match v {
        Value::Int(i) | Value::Pair(i, _) => i,
    }
}

fn mixed_of(v: Value) -> u8 {
    match v {
        Value::Int(i) | Value::Pair(_, i) => i,
    }
}

fn has(v: Value, m: u8) -> bool {
    match v {
        Value::Int(i) => i == m,
        Value::Pair(a, b) => a == m || b == m,
    }
}

#[derive(Clone, Debug)]
enum RefLora {
    Off,
    Special(Vec<u32>),
    Plain(u32),
}

struct Reference {
    sizes: Vec<u32>,
    max_num_seqs: u32,
    q: u32,
    mode: Value,
    lora: RefLora,
    initialized: bool,
    full: Vec<BatchDescriptor>,
    piecewise: Vec<BatchDescriptor>,
}

impl Reference {
    fn pad(&self, n: u32) -> u32 {
        if n == 0 {
            return 0;
        }
        let mut best = u32::MAX;
        for &s in &self.sizes {
            if s >= n && s < best {
                best = s;
            }
        }
        best
    }

    fn padded(&self, n: u32, uniform: bool, has_lora: bool, k: u32) -> Result<BatchDescriptor, ()> {
        let np = self.pad(n);
        let (reqs, uniform) = if uniform && has(self.mode, 2) {
            if !np.is_multiple_of(self.q) {
                return Err(());
            }
            ((np / self.q).min(self.max_num_seqs), true)
        } else {
            (np.min(self.max_num_seqs), false)
        };
        Ok(BatchDescriptor { num_tokens: np, num_reqs: Some(reqs), uniform, has_lora, num_active_loras: k })
    }

    fn cases(&self) -> Vec<u32> {
        match &self.lora {
            RefLora::Off => vec![0],
            RefLora::Special(c) => {
                let mut v = vec![0];
                v.extend(c.iter().copied());
                v
            }
            RefLora::Plain(m) => vec![m + 1],
        }
    }

    fn init(&mut self, mode: GraphMode, q: u32, splitting: bool) -> Result<(), ()> {
        let v = value(mode);
        if has(v, 1) && !splitting {
            return Err(());
        }
        self.mode = v;
        self.q = q;
        self.initialized = true;
        if v == Value::Int(0) {
            return Ok(());
        }
        let cases = self.cases();
        if mixed_of(v) != 0 {
            for &s in &self.sizes.clone() {
                for &k in &cases {
                    let mut d = self.padded(s, false, k > 0, k)?;
                    if mixed_of(v) == 1 {
                        d.num_reqs = None;
                        d.uniform = false;
                        self.piecewise.push(d);
                    } else {
                        self.full.push(d);
                    }
                }
            }
        }
        if decode_of(v) == 2 && matches!(v, Value::Pair(..)) {
            for &s in &self.sizes.clone() {
                if s >= q && s <= q * self.max_num_seqs {
                    for &k in &cases {
                        let d = self.padded(s, true, k > 0, k)?;
                        self.full.push(d);
                    }
                }
            }
        }
        Ok(())
    }

    fn dispatch(
        &self,
        n: u32,
        uniform: bool,
        has_lora: bool,
        k: u32,
        valid: &[u8],
        invalid: &[u8],
    ) -> Result<(RuntimeMode, BatchDescriptor), ()> {
        let base: Vec<u8> = if valid.is_empty() { vec![0, 1, 2] } else { valid.to_vec() };
        let allowed: Vec<u8> = base.into_iter().filter(|m| !invalid.contains(m)).collect();
        if allowed.is_empty() {
            return Err(());
        }
        let max = self.sizes.iter().copied().max().unwrap_or(0);
        let eager = (RuntimeMode::None, BatchDescriptor::unpadded(n));
        if !self.initialized || self.mode == Value::Int(0) || n > max || allowed.iter().all(|&m| m == 0) {
            return Ok(eager);
        }
        let mut k2 = k;
        if has_lora && k > 0 {
            match &self.lora {
                RefLora::Special(c) => {
                    if let Some(&c) = c.iter().find(|&&c| c >= k) {
                        k2 = c;
                    }
                }
                RefLora::Plain(m) => k2 = m + 1,
                RefLora::Off => {}
            }
        }
        let uniform = uniform && matches!(self.mode, Value::Pair(..));
        let d = self.padded(n, uniform, has_lora, k2)?;
        if allowed.contains(&2) && self.full.contains(&d) {
            return Ok((RuntimeMode::Full, d));
        }
        if allowed.contains(&1) {
            let r = BatchDescriptor { num_reqs: None, uniform: false, ..d };
            if self.piecewise.contains(&r) {
                return Ok((RuntimeMode::Piecewise, r));
            }
        }
        if !allowed.contains(&0) {
            return Err(());
        }
        Ok(eager)
    }
}

fn mode_set(bits: u8) -> (ModeSet, Vec<u8>) {
    let modes: Vec<u8> = (0..3).filter(|b| bits & (1 << b) != 0).collect();
    (modes.iter().map(|&m| runtime(m)).collect(), modes)
}

#[derive(Clone, Debug)]
struct Step {
    num_tokens: u32,
    uniform: bool,
    has_lora: bool,
    num_active_loras: u32,
    valid: u8,
    invalid: u8,
}

fn step() -> impl Strategy<Value = Step> {
    (0u32..300, any::<bool>(), any::<bool>(), 0u32..11, 0u8..8, prop_oneof![3 => Just(0u8), 1 => 0u8..8]).prop_map(
        |(num_tokens, uniform, has_lora, num_active_loras, valid, invalid)| Step {
            num_tokens,
            uniform,
            has_lora,
            num_active_loras,
            valid,
            invalid,
        },
    )
}

fn lora() -> impl Strategy<Value = (LoraConfig, RefLora)> {
    prop_oneof![
        Just((LoraConfig::Disabled, RefLora::Off)),
        proptest::collection::btree_set(1u32..9, 0..4).prop_map(|s| {
            let v: Vec<u32> = s.into_iter().collect();
            (LoraConfig::Specialized { captured_counts: v.clone() }, RefLora::Special(v))
        }),
        (1u32..9).prop_map(|m| (LoraConfig::Unspecialized { max_loras: m }, RefLora::Plain(m))),
    ]
}

fn graph_mode() -> impl Strategy<Value = GraphMode> {
    proptest::sample::select(GraphMode::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn dispatch_agrees_with_the_reference_model(
        mode in graph_mode(),
        q in 1u32..5,
        max_num_seqs in 1u32..40,
        raw_sizes in proptest::collection::vec(1u32..70, 0..12),
        multiples in any::<bool>(),
        splitting in prop_oneof![3 => Just(true), 1 => Just(false)],
        init in prop_oneof![9 => Just(true), 1 => Just(false)],
        (lora_cfg, ref_lora) in lora(),
        steps in proptest::collection::vec(step(), 1..48),
    ) {
        // Full decode graphs need whole-request sizes (the builder rounds them); other modes may
        // see any sizes.
        let mult = if multiples || (mode.separate_routine() && mode.decode_mode() == RuntimeMode::Full) { q } else { 1 };
        let sizes: Vec<u32> = raw_sizes.iter().map(|&s| s * mult).collect();
        let Ok(capture_sizes) = CaptureSizes::new(sizes.iter().copied()) else {
            return Err(TestCaseError::fail("sizes rejected"));
        };
        let mut sorted = capture_sizes.sizes().to_vec();
        sorted.dedup();
        let config = DispatcherConfig { capture_sizes, max_num_seqs, lora: lora_cfg, attention_is_splitting_op: splitting };
        let Ok(mut d) = Dispatcher::new(config) else {
            return Err(TestCaseError::fail("dispatcher rejected"));
        };
        let mut r = Reference {
            sizes: sorted, max_num_seqs, q: 1, mode: Value::Int(0), lora: ref_lora,
            initialized: false, full: vec![], piecewise: vec![],
        };
        if init {
            let ours = d.initialize_keys(mode, q);
            let theirs = r.init(mode, q, splitting);
            prop_assert_eq!(ours.is_ok(), theirs.is_ok(), "init: {:?}", ours);
            if ours.is_err() {
                return Ok(());
            }
        }
        let mut ok = 0;
        for s in &steps {
            let (valid, vref) = mode_set(s.valid);
            let (invalid, iref) = mode_set(s.invalid);
            let ours = d.dispatch(s.num_tokens, s.uniform, s.has_lora, s.num_active_loras, valid, invalid);
            let theirs = r.dispatch(s.num_tokens, s.uniform, s.has_lora, s.num_active_loras, &vref, &iref);
            match (&ours, &theirs) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(a, b, "step {:?}", s);
                    ok += 1;
                }
                (Err(_), Err(())) => {}
                _ => prop_assert!(false, "step {:?}: ours {:?}, reference {:?}", s, ours, theirs),
            }
        }
        prop_assert_eq!(d.stats().dispatches(), ok);

        // The capture list is exactly the reference's keys, PIECEWISE then FULL, largest first.
        let descs = d.capture_descs();
        let mut want = vec![];
        for (m, keys) in [(RuntimeMode::Piecewise, &r.piecewise), (RuntimeMode::Full, &r.full)] {
            let mut k = keys.clone();
            k.sort();
            k.dedup();
            if !k.is_empty() {
                want.push((m, k));
            }
        }
        prop_assert_eq!(descs.len(), want.len());
        for ((m, got), (wm, wk)) in descs.iter().zip(&want) {
            prop_assert_eq!(m, wm);
            prop_assert!(got.windows(2).all(|w| (w[0].num_tokens, w[0].num_active_loras) >= (w[1].num_tokens, w[1].num_active_loras)));
            let mut g = got.clone();
            g.sort();
            prop_assert_eq!(&g, wk);
        }
    }

    #[test]
    fn every_graph_dispatch_returns_a_captured_key_padded_at_or_above_the_step(
        mode in graph_mode(),
        max_num_seqs in 1u32..40,
        raw_sizes in proptest::collection::vec(1u32..600, 1..20),
        steps in proptest::collection::vec(step(), 1..64),
    ) {
        let Ok(capture_sizes) = CaptureSizes::new(raw_sizes) else {
            return Err(TestCaseError::fail("sizes rejected"));
        };
        let config = DispatcherConfig { capture_sizes, max_num_seqs, lora: LoraConfig::Disabled, attention_is_splitting_op: true };
        let Ok(mut d) = Dispatcher::new(config) else {
            return Err(TestCaseError::fail("dispatcher rejected"));
        };
        prop_assert!(d.initialize_keys(mode, 1).is_ok());
        for s in &steps {
            let (valid, _) = mode_set(s.valid);
            let (invalid, _) = mode_set(s.invalid);
            if let Ok((m, desc)) = d.dispatch(s.num_tokens, s.uniform, false, 0, valid, invalid) {
                match m {
                    RuntimeMode::None => prop_assert_eq!(desc, BatchDescriptor::unpadded(s.num_tokens)),
                    _ => {
                        prop_assert!(d.has_key(m, &desc));
                        prop_assert!(desc.num_tokens >= s.num_tokens);
                        prop_assert!(d.capture_sizes().sizes().contains(&desc.num_tokens));
                    }
                }
            }
        }
        let st = d.stats();
        prop_assert!(st.padded_tokens() >= st.real_tokens());
    }
}
