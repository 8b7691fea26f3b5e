//! A hash set of [`BatchDescriptor`]s with a small multiplicative hasher: dispatch does one or
//! two lookups per step, and the standard SipHash would be most of its cost. Keys are built by
//! this crate from capture sizes, never by an adversary, so a non-keyed hash is fine.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use crate::descriptor::BatchDescriptor;

/// Rotate-xor-multiply hasher (the "Fx" scheme used by rustc), 64-bit.
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl KeyHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for KeyHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn write_isize(&mut self, i: isize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// The set of keys captured for one runtime mode.
pub(crate) type KeySet = HashSet<BatchDescriptor, BuildHasherDefault<KeyHasher>>;
