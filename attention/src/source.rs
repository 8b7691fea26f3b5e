//! DeepSeek-V4 metadata kernels: CUDA C that is also valid HIP, with their CPU references.
//!
//! All of them map 32-bit positions, slots and block ids, so the CPU references and the device
//! kernels agree bit for bit. Launch shapes depend only on view lengths (padded row counts),
//! never on contents. A token is valid when its slot is ≥ 0 and it belongs to a request (≥ 0).
//! Block tables are indexed by table row, not batch row: token `t` of request `r = tok_req[t]`
//! reads block `c` at `block_table[table_rows[r] · bt_width + c]`; `hf_dsv4_step_upload` copies
//! each step's fields from the mapped host staging and writes its updates into the persistent
//! tables.

use std::sync::OnceLock;

use holdfast_hal::{CpuLaunch, CpuPtr, KernelEntry, KernelSource, Param, Result, ScalarKind};

const CODE: &str = r#"
// Global slot of token position p through one block-table row.
__device__ __forceinline__ int32_t hf_slot(const int32_t* row, int32_t p, int32_t bs) {
    return row[p / bs] * bs + p % bs;
}

// Token t's SWA list length: min(pos + 1, window), 0 for an invalid token.
// (The three loads are unconditional, so a loop of these keeps them all in flight.)
__device__ __forceinline__ int32_t hf_swa_len(const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                                              uint32_t t, uint32_t window) {
    const int32_t s = slots[t], r = tok_req[t];
    const uint32_t p1 = (uint32_t)positions[t] + 1u;  // unsigned: no overflow on a padding row
    const int32_t len = (int32_t)(p1 < window ? p1 : window);
    return (s < 0 || r < 0) ? 0 : len;
}

// Token t's c128a list length: min((pos + 1) / ratio, width), 0 for an invalid token.
__device__ __forceinline__ int32_t hf_c128a_len(const int32_t* positions, const int32_t* slots,
                                                const int32_t* tok_req, uint32_t t, uint32_t width, uint32_t ratio) {
    const int32_t s = slots[t], r = tok_req[t];
    const uint32_t c = ((uint32_t)positions[t] + 1u) / ratio;
    return (s < 0 || r < 0) ? 0 : (int32_t)(c < width ? c : width);
}

// One block (power-of-two threads) per decode token: indices[t, j] = SWA slot of position
// max(pos - window + 1, 0) + j for j < len = min(pos + 1, window), -1 after (len 0 and an all -1
// row for invalid tokens); lens[t] = len; and the ragged form in the same launch: indptr[t + 1] =
// the lengths of tokens 0..t summed (the block recomputes the earlier tokens' lengths from their
// positions), flat[indptr[t] + j] = indices[t, j] for j < len.
HF_KERNEL void hf_dsv4_swa_decode(const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                                  const int32_t* table_rows, const int32_t* block_table, int32_t* indices,
                                  int32_t* lens, int32_t* indptr, int32_t* flat, uint32_t n, uint32_t window,
                                  uint32_t block_size, uint32_t bt_width) {
    hf_dependent_kernel_start();
    __shared__ int32_t part[1024];
    if (blockIdx.x == 0 && threadIdx.x == 0) indptr[0] = 0;
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        const int32_t before =
            hf_thread_sum_below(t, [&](uint32_t q) { return hf_swa_len(positions, slots, tok_req, q, window); });
        const int32_t base = hf_block_sum_i32(before, part);
        int32_t req = tok_req[t];
        bool valid = slots[t] >= 0 && req >= 0;
        int32_t pos = valid ? positions[t] : 0;
        int32_t start = pos - (int32_t)window + 1;
        if (start < 0) start = 0;
        int32_t len = valid ? pos + 1 - start : 0;
        const int32_t* row = block_table + (uint64_t)(valid ? table_rows[req] : 0) * bt_width;
        for (uint32_t j = threadIdx.x; j < window; j += blockDim.x) {
            int32_t v = (int32_t)j < len ? hf_slot(row, start + (int32_t)j, (int32_t)block_size) : -1;
            indices[(uint64_t)t * window + j] = v;
            if ((int32_t)j < len) flat[base + (int32_t)j] = v;
        }
        if (threadIdx.x == 0) {
            lens[t] = len;
            indptr[t + 1] = base + len;
        }
    }
}

// One thread per prefill request: gather_lens[i] = query_len + min(seq_len - query_len, window - 1).
HF_KERNEL void hf_dsv4_swa_prefill_gather_lens(const int32_t* qsl, const int32_t* seq_lens, int32_t* out,
                                               uint32_t n, uint32_t window) {
    hf_dependent_kernel_start();
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int32_t q = qsl[i + 1] - qsl[i];
        int32_t prefix = seq_lens[i] - q;
        int32_t w = (int32_t)window - 1;
        out[i] = q + (prefix < w ? prefix : w);
    }
}

// One block (power-of-two threads) per decode token: the first n = min((pos + 1) / ratio, width)
// compressed entries' global slots (compressed block size cbs), -1 after; lens[t] = n, 0 (and all
// -1) if invalid; and, in the same launch, indptr / flat as hf_dsv4_swa_decode. Where the dense
// rows are 16-byte aligned (width % 4 == 0 and an aligned buffer) each thread makes four
// consecutive entries (one division for the four, one 16-byte streaming store of the dense
// row). The table entries a row reads (up to HF_C128A_TROW) are staged in shared memory first,
// so the passes that write never wait on a table load behind the stream of stores. With early_tail
// (the launcher's choice: it changes no output) the row's -1 tail past its list's last group of
// four is stored before that, while the table row and the lengths before the row load.
struct alignas(16) hf_md_i4 { int32_t v[4]; };
// A 16-byte store of a dense c128a row that L2 may evict first (NVIDIA st.global.cs, "streaming"):
// nothing in the step reads the dense rows back (the attention reads the ragged lists), and at
// 1024 rows of a 1M context they are 32 MiB, which normal stores keep in L2 against the block
// table, the lengths and the ragged lists that the builds still read and write (upload + c128a
// build at 1024 rows on an H100: 29.7 -> 26.5 µs).
__device__ __forceinline__ void hf_md_store_cs(hf_md_i4* p, const hf_md_i4& x) {
#if defined(HF_CUDA)
    asm volatile("st.global.cs.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x.v[0]), "r"(x.v[1]), "r"(x.v[2]),
                 "r"(x.v[3])
                 : "memory");
#else
    *p = x;
#endif
}
#define HF_MD_ROUNDS 4
// Table entries a c128a block stages in shared memory before it writes (16 KiB): a row that needs
// more reads the table directly.
#define HF_C128A_TROW 4096
// Starts copying row[0 .. need) (need <= HF_C128A_TROW) into shared dst, every load in flight at
// once (cp.async where the row is 16-byte aligned on sm_80+); hf_md_stage_wait() completes it for
// the whole block. A 16-byte chunk past `need` stays inside the table: a row that needs entries
// belongs to a request, and the null row follows every request's row.
__device__ __forceinline__ void hf_md_stage(const int32_t* row, uint32_t need, int32_t* dst) {
#if defined(HF_HAS_MMA)
    if ((reinterpret_cast<uint64_t>(row) & 15u) == 0u) {
        for (uint32_t i = threadIdx.x; 4u * i < need; i += blockDim.x)
            hf_cp_async16(hf_smem_addr(dst + 4u * i), row + 4u * i, 16u);
        hf_cp_async_commit();
        return;
    }
#endif
    for (uint32_t i = threadIdx.x; i < need; i += blockDim.x) dst[i] = row[i];
}
__device__ __forceinline__ void hf_md_stage_wait() {
#if defined(HF_HAS_MMA)
    hf_cp_async_wait_all();
#endif
    __syncthreads();
}
HF_KERNEL void hf_dsv4_c128a_decode(const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                                    const int32_t* table_rows, const int32_t* block_table, int32_t* indices,
                                    int32_t* lens, int32_t* indptr, int32_t* flat, uint32_t n, uint32_t width,
                                    uint32_t ratio, uint32_t cbs, uint32_t bt_width, uint32_t early_tail) {
    hf_dependent_kernel_start();
    __shared__ int32_t part[1024];
    __shared__ hf_md_i4 trow4[HF_C128A_TROW / 4];  // 16-byte aligned through its type
    int32_t* trow = trow4[0].v;
    if (blockIdx.x == 0 && threadIdx.x == 0) indptr[0] = 0;
    const bool vec = width % 4u == 0u && (reinterpret_cast<uint64_t>(indices) & 15u) == 0u;
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        __syncthreads();  // the previous row's readers of trow are done
        // The row's table entries first: their loads are in flight while the block sums the
        // lengths before its row, and the stores below never wait on the table.
        int32_t req = tok_req[t];
        bool valid = slots[t] >= 0 && req >= 0;
        const int32_t c = hf_c128a_len(positions, slots, tok_req, t, width, ratio);
        const int32_t* table_row = block_table + (uint64_t)(valid ? table_rows[req] : 0) * bt_width;
        const uint32_t need = ((uint32_t)c + cbs - 1u) / cbs;
        const bool staged = need <= HF_C128A_TROW;
        if (staged) hf_md_stage(table_row, need, trow);
        int32_t* dense = indices + (uint64_t)t * width;
        // With early_tail, the dense row's -1 tail from the first 16-byte group past the list
        // (it depends on the length alone) is stored while the table row and the lengths before
        // this row are still in flight; the passes below write the groups before it.
        const uint32_t tail = vec && early_tail ? (((uint32_t)c + 3u) & ~3u) : width;
        if (vec && early_tail) {
            const hf_md_i4 none = {{-1, -1, -1, -1}};
            for (uint32_t j0 = tail + 4u * threadIdx.x; j0 < width; j0 += 4u * blockDim.x)
                hf_md_store_cs(reinterpret_cast<hf_md_i4*>(dense + j0), none);
        }
        const int32_t before =
            hf_thread_sum_below(t, [&](uint32_t q) { return hf_c128a_len(positions, slots, tok_req, q, width, ratio); });
        const int32_t base = hf_block_sum_i32(before, part);
        if (staged) hf_md_stage_wait();
        const int32_t* row = staged ? trow : table_row;
        if (vec) {
            // HF_MD_ROUNDS groups of four per pass, their table reads all in flight before any store.
            const uint32_t step = 4u * blockDim.x, lane = threadIdx.x % HF_WARP_SIZE;
            // The bound is the warp's first entry, so whole warps take part in the shuffles.
            for (uint32_t p0 = 4u * threadIdx.x; p0 - 4u * lane < tail; p0 += HF_MD_ROUNDS * step) {
                hf_md_i4 o[HF_MD_ROUNDS];
#pragma unroll
                for (int g = 0; g < HF_MD_ROUNDS; ++g) {
                    const uint32_t j0 = p0 + (uint32_t)g * step;
                    uint32_t q = j0 / cbs, r = j0 % cbs;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int32_t j = (int32_t)j0 + e;
                        o[g].v[e] = j < c ? row[q] * (int32_t)cbs + (int32_t)r : -1;
                        if (++r == cbs) {
                            r = 0u;
                            ++q;
                        }
                    }
                }
                // The ragged copy: a warp's 4 · warp entries are contiguous, so they are
                // transposed with shuffles and stored one word per lane (whole lines, whatever
                // the row's offset), not four words per lane at a 16-byte stride.
#pragma unroll
                for (int g = 0; g < HF_MD_ROUNDS; ++g) {
                    const uint32_t j0 = p0 + (uint32_t)g * step;
                    if (j0 < tail) hf_md_store_cs(reinterpret_cast<hf_md_i4*>(dense + j0), o[g]);
                    const uint32_t wbase = j0 - 4u * lane;  // the warp's first entry
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const uint32_t q = (uint32_t)r * HF_WARP_SIZE + lane;
                        const int src = (int)(q >> 2);
                        const int32_t x0 = hf_shfl(o[g].v[0], src), x1 = hf_shfl(o[g].v[1], src);
                        const int32_t x2 = hf_shfl(o[g].v[2], src), x3 = hf_shfl(o[g].v[3], src);
                        const uint32_t e = q & 3u;
                        const int32_t val = e == 0u ? x0 : e == 1u ? x1 : e == 2u ? x2 : x3;
                        const int32_t jq = (int32_t)(wbase + q);
                        if (jq < c) flat[base + jq] = val;
                    }
                }
            }
        } else {
            for (uint32_t j = threadIdx.x; j < width; j += blockDim.x) {
                const int32_t v = (int32_t)j < c ? hf_slot(row, (int32_t)j, (int32_t)cbs) : -1;
                dense[j] = v;
                if ((int32_t)j < c) flat[base + (int32_t)j] = v;
            }
        }
        if (threadIdx.x == 0) {
            lens[t] = c;
            indptr[t + 1] = base + c;
        }
    }
}

// One block per prefill token: local indices 0 .. n - 1 of its visible compressed entries, -1 after.
HF_KERNEL void hf_dsv4_c128a_prefill(const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                                     int32_t* indices, uint32_t n, uint32_t width, uint32_t ratio) {
    hf_dependent_kernel_start();
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        bool valid = slots[t] >= 0 && tok_req[t] >= 0;
        uint32_t c = valid ? ((uint32_t)positions[t] + 1u) / ratio : 0u;
        if (c > width) c = width;
        for (uint32_t j = threadIdx.x; j < width; j += blockDim.x)
            indices[(uint64_t)t * width + j] = j < c ? (int32_t)j : -1;
    }
}

// c4a top-k: entry v of token t's row is kept iff the token is valid and 0 <= v < (pos + 1) / ratio
// (a compressed entry that exists). Blocks of exactly HF_C4A_THREADS threads, one block per token.
#define HF_C4A_THREADS 128
#define HF_C4A_UNROLL 8
__device__ __forceinline__ bool hf_c4a_keep(int32_t v, int32_t avail) { return v >= 0 && v < avail; }

// The c4a decode build in one launch, one pass over the rows, no grid-wide wait: a block takes
// rows by ticket (sync[0], in the order blocks start), counts row t's kept entries (lens[t]),
// and finds the kept entries of every row before it by a chained scan over per-row status words
// (status[t]: a flag, HF_C4A_AGG = "its own count is here" or HF_C4A_INC = "the count of rows
// 0 ..= t is here", in the top bits, the value below): warp 0 looks back a warp's width of rows
// at a time and stops at the nearest row that published its inclusive sum. A block only waits
// for rows of lower tickets, whose blocks are already running and wait only for rows lower
// still, so the scan needs no co-residency. Then indptr[t + 1] = (rows 0 ..= t), and flat[indptr[t]
// + i] = the global slot of the i-th kept entry of row t (row order preserved: thread h owns the
// contiguous chunk [h * ceil(k / T), ...) of the row and a block scan orders the threads). The
// last block to finish (sync[1]) zeroes the status words and both counters for the next launch.
// Integer sums only: exact in any order, so the output does not depend on which block took
// which row. Where the launcher says the whole grid is resident at once (`resident`: one block
// per row and at most half the multiprocessors' worth of blocks, so no block waits on one that
// never starts), block b takes row b and no other, with no ticket round trips to L2.
#define HF_C4A_AGG 0x40000000u
#define HF_C4A_INC 0x80000000u
#define HF_C4A_VALUE 0x3fffffffu
HF_KERNEL void hf_dsv4_c4a_decode(const int32_t* topk, const int32_t* positions, const int32_t* slots,
                                  const int32_t* tok_req, const int32_t* table_rows, const int32_t* block_table,
                                  int32_t* lens, int32_t* indptr, int32_t* flat, int32_t* sync_i, int32_t* status_i,
                                  uint32_t n, uint32_t k, uint32_t ratio, uint32_t cbs, uint32_t bt_width,
                                  uint32_t resident) {
    hf_dependent_kernel_start();
    __shared__ int32_t part[HF_C4A_THREADS];
    __shared__ uint32_t s_ticket, s_last;
    __shared__ int32_t s_base;
    uint32_t* sync = reinterpret_cast<uint32_t*>(sync_i);
    uint32_t* status = reinterpret_cast<uint32_t*>(status_i);
    const volatile uint32_t* vstatus = status;
    const uint32_t chunk = (k + HF_C4A_THREADS - 1) / HF_C4A_THREADS;
    const uint32_t begin = threadIdx.x * chunk;
    const uint32_t end = begin + chunk < k ? begin + chunk : k;
    const bool held = chunk <= HF_C4A_UNROLL;
    const int lane = (int)(threadIdx.x % HF_WARP_SIZE);
    for (uint32_t pass = 0;; ++pass) {
        __syncthreads();  // the previous row's readers of s_ticket and s_base are done
        if (threadIdx.x == 0) s_ticket = resident ? (pass == 0 ? blockIdx.x : n) : atomicAdd(&sync[0], 1u);
        __syncthreads();
        const uint32_t t = s_ticket;
        if (t >= n) break;
        const int32_t req = tok_req[t];
        const bool valid = slots[t] >= 0 && req >= 0;
        const int32_t avail = valid ? (int32_t)(((uint32_t)positions[t] + 1u) / ratio) : 0;
        const int32_t* in = topk + (uint64_t)t * k;
        // Chunks of up to HF_C4A_UNROLL entries (index_topk <= 1024) are held in registers, their
        // loads (and then their table reads) all in flight at once.
        int32_t v[HF_C4A_UNROLL];
        int32_t c = 0;
        if (held) {
#pragma unroll
            for (int e = 0; e < HF_C4A_UNROLL; ++e) v[e] = begin + (uint32_t)e < end ? in[begin + e] : -1;
#pragma unroll
            for (int e = 0; e < HF_C4A_UNROLL; ++e) c += hf_c4a_keep(v[e], avail);
        } else {
            for (uint32_t j = begin; j < end; ++j) c += hf_c4a_keep(in[j], avail);
        }
        const int32_t* row = block_table + (uint64_t)(valid ? table_rows[req] : 0) * bt_width;
        int32_t kept;
        const int32_t off = hf_block_exclusive_scan_i32(c, part, &kept);
        if (threadIdx.x < HF_WARP_SIZE) {
            int32_t base = 0;
            if (t > 0) {
                if (threadIdx.x == 0) atomicExch(&status[t], HF_C4A_AGG | (uint32_t)kept);
                for (int64_t top = (int64_t)t;; top -= HF_WARP_SIZE) {
                    // Lane i reads row top - 1 - i (rows below 0 read as an inclusive 0).
                    const int64_t q = top - 1 - lane;
                    uint32_t w = HF_C4A_INC;
                    if (q >= 0) {
                        do w = vstatus[q];
                        while (w == 0u);
                    }
                    // The nearest lane holding an inclusive sum; lanes up to it add their values.
                    int first = (w & HF_C4A_INC) ? lane : HF_WARP_SIZE;
                    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) {
                        const int o = hf_shfl_xor(first, m);
                        first = o < first ? o : first;
                    }
                    int32_t x = lane <= first ? (int32_t)(w & HF_C4A_VALUE) : 0;
                    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) x += hf_shfl_xor(x, m);
                    base += x;
                    if (first < HF_WARP_SIZE) break;
                }
            }
            if (threadIdx.x == 0) {
                atomicExch(&status[t], HF_C4A_INC | (uint32_t)(base + kept));
                s_base = base;
                lens[t] = kept;
                indptr[t + 1] = base + kept;
                if (t == 0) indptr[0] = 0;
            }
        }
        __syncthreads();
        int32_t out = s_base + off;
        if (held) {
            int32_t slot[HF_C4A_UNROLL];
#pragma unroll
            for (int e = 0; e < HF_C4A_UNROLL; ++e) slot[e] = hf_c4a_keep(v[e], avail) ? hf_slot(row, v[e], (int32_t)cbs) : 0;
#pragma unroll
            for (int e = 0; e < HF_C4A_UNROLL; ++e)
                if (hf_c4a_keep(v[e], avail)) flat[out++] = slot[e];
        } else {
            for (uint32_t j = begin; j < end; ++j) {
                int32_t x = in[j];
                if (hf_c4a_keep(x, avail)) flat[out++] = hf_slot(row, x, (int32_t)cbs);
            }
        }
    }
    // Leave: the last block clears the status words and the counters, after every block's
    // status and ticket writes (so no late status word outlives the reset).
    if (hf_block_arrives_last(&sync[1], gridDim.x, &s_last)) {
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) status[i] = 0u;
        if (threadIdx.x == 0) {
            sync[0] = 0u;
            sync[1] = 0u;
        }
    }
}

// The step upload, reading the mapped host staging in place (no copy engine): step[0 .. words) =
// staging[0 .. words), then the block-table updates at staging[at]: staging[at] = n (clamped to
// [0, capacity]), then n pairs (cell, block); a cell below swa_cells indexes the SWA table, the
// others the KV table at cell - swa_cells; cells out of both are skipped. Every thread issues its
// loads (a group of four words, the count and one pair) before any store, so the host link is
// crossed once per launch; the launch shape depends only on words and capacity.
HF_KERNEL void hf_dsv4_step_upload(const int32_t* staging, int32_t* step, int32_t* swa_table, int32_t* kv_table,
                                   uint32_t words, uint32_t at, uint32_t capacity, uint32_t swa_cells,
                                   uint32_t kv_cells) {
    hf_dependent_kernel_start();
    const uint32_t groups = (words + 3u) / 4u;
    const bool vec = ((reinterpret_cast<uint64_t>(staging) | reinterpret_cast<uint64_t>(step)) & 15u) == 0u;
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < groups || i < capacity; i += stride) {
        const uint32_t w0 = 4u * i;
        const bool whole = vec && w0 + 4u <= words;
        hf_md_i4 w = {{0, 0, 0, 0}};
        if (whole) {
            w = *reinterpret_cast<const hf_md_i4*>(staging + w0);
        } else if (i < groups) {
#pragma unroll
            for (uint32_t e = 0; e < 4u; ++e)
                if (w0 + e < words) w.v[e] = staging[w0 + e];
        }
        int32_t count = 0, cell = 0, block = 0;
        if (i < capacity) {
            count = staging[at];
            cell = staging[at + 1u + 2u * (uint64_t)i];
            block = staging[at + 2u + 2u * (uint64_t)i];
        }
        if (whole) {
            *reinterpret_cast<hf_md_i4*>(step + w0) = w;
        } else if (i < groups) {
#pragma unroll
            for (uint32_t e = 0; e < 4u; ++e)
                if (w0 + e < words) step[w0 + e] = w.v[e];
        }
        const uint32_t n = count < 0 ? 0u : ((uint32_t)count < capacity ? (uint32_t)count : capacity);
        if (i < n) {
            const uint32_t c = (uint32_t)cell;
            if (c < swa_cells) swa_table[c] = block;
            else if (c - swa_cells < kv_cells) kv_table[c - swa_cells] = block;
        }
    }
}
"#;

/// Threads per block of the step upload.
pub(crate) const UPLOAD_THREADS: u32 = 256;

/// Threads per block of the c4a kernel (its launcher must use exactly this many).
pub const C4A_THREADS: u32 = 128;
/// Counter words of the c4a kernel's `sync` buffer (zero between launches).
pub const C4A_SYNC_WORDS: usize = 2;
/// Most kept entries of one c4a build (`rows × topk`): the value field of the kernel's chained-scan
/// status words (30 bits).
pub const C4A_MAX_ENTRIES: usize = (1 << 30) - 1;

/// `(valid, position, request)` of token `t`.
fn token(pos: &CpuPtr<'_, i32>, slots: &CpuPtr<'_, i32>, req: &CpuPtr<'_, i32>, t: usize) -> Result<(bool, i64, i64)> {
    let r = req.get(t)?;
    let valid = slots.get(t)? >= 0 && r >= 0;
    Ok((valid, if valid { i64::from(pos.get(t)?) } else { 0 }, i64::from(r)))
}

/// Table row of request `r` (a valid token's request).
fn table_row(rows: &CpuPtr<'_, i32>, r: i64) -> Result<i64> {
    Ok(i64::from(rows.get_signed(r)?))
}

fn slot(bt: &CpuPtr<'_, i32>, row: i64, width: usize, p: i64, bs: i64) -> Result<i32> {
    let block = bt.get_signed(row * width as i64 + p / bs)?;
    Ok((i64::from(block) * bs + p % bs) as i32)
}

/// Writes row `t` of a decode list: the dense row (`width` entries, -1 padded), its length, and
/// its ragged form at `*base` (then advances `*base` and writes `indptr[t + 1]`).
struct RaggedOut<'a> {
    idx: CpuPtr<'a, i32>,
    lens: CpuPtr<'a, i32>,
    indptr: CpuPtr<'a, i32>,
    flat: CpuPtr<'a, i32>,
    base: i32,
}

impl RaggedOut<'_> {
    fn row(&mut self, t: usize, width: usize, row: &[i32], len: usize) -> Result<()> {
        if t == 0 {
            self.indptr.set(0, 0)?;
        }
        self.idx.write(t * width, row)?;
        self.lens.set(t, len as i32)?;
        if len > 0 {
            self.flat.write(self.base as usize, &row[..len])?;
        }
        self.base = self.base.wrapping_add(len as i32);
        self.indptr.set(t + 1, self.base)
    }
}

fn swa_decode(l: &CpuLaunch<'_>) -> Result<()> {
    let (pos, slots, req, rows) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let bt = l.ptr::<i32>(4)?;
    let mut out = RaggedOut { idx: l.ptr(5)?, lens: l.ptr(6)?, indptr: l.ptr(7)?, flat: l.ptr(8)?, base: 0 };
    let (n, window, bs, w) = (l.count(9)?, l.count(10)?, l.count(11)? as i64, l.count(12)?);
    if n == 0 {
        out.indptr.set(0, 0)?;
    }
    let mut row = vec![-1i32; window];
    for t in 0..n {
        let (valid, p, r) = token(&pos, &slots, &req, t)?;
        let start = (p - window as i64 + 1).max(0);
        let len = if valid { p + 1 - start } else { 0 };
        row.fill(-1);
        if len > 0 {
            let tr = table_row(&rows, r)?;
            for (j, v) in row.iter_mut().enumerate().take(len as usize) {
                *v = slot(&bt, tr, w, start + j as i64, bs)?;
            }
        }
        out.row(t, window, &row, len as usize)?;
    }
    Ok(())
}

fn swa_prefill_gather_lens(l: &CpuLaunch<'_>) -> Result<()> {
    let (qsl, seq, out) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?);
    let (n, window) = (l.count(3)?, l.count(4)? as i32);
    for i in 0..n {
        let q = qsl.get(i + 1)?.wrapping_sub(qsl.get(i)?);
        let prefix = seq.get(i)?.wrapping_sub(q);
        out.set(i, q.wrapping_add(prefix.min(window - 1)))?;
    }
    Ok(())
}

fn compressed_count(valid: bool, p: i64, ratio: i64, width: usize) -> usize {
    if valid {
        (((p + 1) / ratio) as usize).min(width)
    } else {
        0
    }
}

fn c128a_decode(l: &CpuLaunch<'_>) -> Result<()> {
    let (pos, slots, req, rows) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let bt = l.ptr::<i32>(4)?;
    let mut out = RaggedOut { idx: l.ptr(5)?, lens: l.ptr(6)?, indptr: l.ptr(7)?, flat: l.ptr(8)?, base: 0 };
    let (n, width, ratio, cbs, w) = (l.count(9)?, l.count(10)?, l.count(11)? as i64, l.count(12)? as i64, l.count(13)?);
    if n == 0 {
        out.indptr.set(0, 0)?;
    }
    let mut row = vec![-1i32; width];
    for t in 0..n {
        let (valid, p, r) = token(&pos, &slots, &req, t)?;
        let c = compressed_count(valid, p, ratio, width);
        row.fill(-1);
        if c > 0 {
            let tr = table_row(&rows, r)?;
            for (j, v) in row.iter_mut().enumerate().take(c) {
                *v = slot(&bt, tr, w, j as i64, cbs)?;
            }
        }
        out.row(t, width, &row, c)?;
    }
    Ok(())
}

fn c128a_prefill(l: &CpuLaunch<'_>) -> Result<()> {
    let (pos, slots, req, idx) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let (n, width, ratio) = (l.count(4)?, l.count(5)?, l.count(6)? as i64);
    let mut row = vec![-1i32; width];
    for t in 0..n {
        let (valid, p, _) = token(&pos, &slots, &req, t)?;
        let c = compressed_count(valid, p, ratio, width);
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j < c { j as i32 } else { -1 };
        }
        idx.write(t * width, &row)?;
    }
    Ok(())
}

fn c4a_decode(l: &CpuLaunch<'_>) -> Result<()> {
    let (topk, pos, slots, req) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let (rows, bt, lens) = (l.ptr::<i32>(4)?, l.ptr::<i32>(5)?, l.ptr::<i32>(6)?);
    let (indptr, flat, sync, status) = (l.ptr::<i32>(7)?, l.ptr::<i32>(8)?, l.ptr::<i32>(9)?, l.ptr::<i32>(10)?);
    let (n, k, ratio, cbs, w) = (l.count(11)?, l.count(12)?, l.count(13)? as i64, l.count(14)? as i64, l.count(15)?);
    if sync.len() < C4A_SYNC_WORDS {
        return Err(l.fail(format!("`sync` holds {} words, the launch needs {C4A_SYNC_WORDS}", sync.len())));
    }
    if status.len() < n {
        return Err(l.fail(format!("`status` holds {} words, {n} rows need one each", status.len())));
    }
    if n.checked_mul(k).is_none_or(|e| e > C4A_MAX_ENTRIES) {
        return Err(l.fail(format!("{n} rows × {k} entries exceed the {C4A_MAX_ENTRIES} a build can count")));
    }
    // (1) The lengths, then (2) their exclusive scan (two's-complement adds, as the device's)
    // and the pack.
    let mut keep = Vec::with_capacity(n);
    for t in 0..n {
        let (valid, p, r) = token(&pos, &slots, &req, t)?;
        keep.push((valid, if valid { (p + 1) / ratio } else { 0 }, r));
    }
    let mut starts = Vec::with_capacity(n + 1);
    starts.push(0i32);
    for (t, &(_, avail, _)) in keep.iter().enumerate() {
        let c = topk.read(t * k, k)?.into_iter().filter(|&v| v >= 0 && i64::from(v) < avail).count() as i32;
        lens.set(t, c)?;
        starts.push(starts[t].wrapping_add(c));
    }
    indptr.write(0, &starts)?;
    let mut out = Vec::with_capacity(k);
    for (t, &(valid, avail, r)) in keep.iter().enumerate() {
        out.clear();
        let tr = if valid { table_row(&rows, r)? } else { 0 };
        for v in topk.read(t * k, k)? {
            if v >= 0 && i64::from(v) < avail {
                out.push(slot(&bt, tr, w, i64::from(v), cbs)?);
            }
        }
        if out.is_empty() {
            continue;
        }
        let base = starts[t];
        let base = usize::try_from(base).map_err(|_| l.fail(format!("indptr[{t}] = {base} is negative")))?;
        flat.write(base, &out)?;
    }
    Ok(())
}

fn step_upload(l: &CpuLaunch<'_>) -> Result<()> {
    let (staging, step, swa, kv) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let (words, at, cap, swa_cells, kv_cells) = (l.count(4)?, l.count(5)?, l.count(6)?, l.count(7)?, l.count(8)?);
    step.write(0, &staging.read(0, words)?)?;
    let n = usize::try_from(staging.get(at)?).unwrap_or(0).min(cap);
    for p in staging.read(at + 1, 2 * n)?.chunks_exact(2) {
        let (cell, block) = (p[0] as u32 as usize, p[1]);
        if cell < swa_cells {
            swa.set(cell, block)?;
        } else if cell - swa_cells < kv_cells {
            kv.set(cell - swa_cells, block)?;
        }
    }
    Ok(())
}

/// The `holdfast_attention` kernel source with all entry points.
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |n| Param::scalar(n, ScalarKind::U32);
        let inp = Param::input::<i32>;
        let out = Param::output::<i32>;
        KernelSource {
            name: "holdfast_attention",
            code: CODE,
            entries: vec![
                KernelEntry {
                    name: "hf_dsv4_swa_decode",
                    params: vec![
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("table_rows"),
                        inp("block_table"),
                        out("indices"),
                        out("lens"),
                        out("indptr"),
                        out("flat"),
                        u("n"),
                        u("window"),
                        u("block_size"),
                        u("bt_width"),
                    ],
                    cpu: swa_decode,
                },
                KernelEntry {
                    name: "hf_dsv4_swa_prefill_gather_lens",
                    params: vec![inp("qsl"), inp("seq_lens"), out("out"), u("n"), u("window")],
                    cpu: swa_prefill_gather_lens,
                },
                KernelEntry {
                    name: "hf_dsv4_c128a_decode",
                    params: vec![
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("table_rows"),
                        inp("block_table"),
                        out("indices"),
                        out("lens"),
                        out("indptr"),
                        out("flat"),
                        u("n"),
                        u("width"),
                        u("ratio"),
                        u("cbs"),
                        u("bt_width"),
                        u("early_tail"),
                    ],
                    cpu: c128a_decode,
                },
                KernelEntry {
                    name: "hf_dsv4_c128a_prefill",
                    params: vec![
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        out("indices"),
                        u("n"),
                        u("width"),
                        u("ratio"),
                    ],
                    cpu: c128a_prefill,
                },
                KernelEntry {
                    name: "hf_dsv4_c4a_decode",
                    params: vec![
                        inp("topk"),
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("table_rows"),
                        inp("block_table"),
                        Param::inout::<i32>("lens"),
                        out("indptr"),
                        out("flat"),
                        Param::inout::<i32>("sync"),
                        Param::inout::<i32>("status"),
                        u("n"),
                        u("k"),
                        u("ratio"),
                        u("cbs"),
                        u("bt_width"),
                        u("resident"),
                    ],
                    cpu: c4a_decode,
                },
                KernelEntry {
                    name: "hf_dsv4_step_upload",
                    params: vec![
                        inp("staging"),
                        out("step"),
                        Param::inout::<i32>("swa_table"),
                        Param::inout::<i32>("kv_table"),
                        u("words"),
                        u("at"),
                        u("capacity"),
                        u("swa_cells"),
                        u("kv_cells"),
                    ],
                    cpu: step_upload,
                },
            ],
        }
    })
}

/// One block per row (at least one, at most 65535 blocks; kernels loop over the rest).
pub(crate) fn row_grid(rows: usize, block: u32) -> holdfast_hal::LaunchConfig {
    holdfast_hal::LaunchConfig::blocks(rows.clamp(1, 65535) as u32, block)
}

/// The compiled DeepSeek-V4 metadata kernels of one device.
#[derive(Clone, Debug)]
pub(crate) struct AttnKernels {
    pub(crate) swa_decode: holdfast_hal::Kernel,
    pub(crate) swa_prefill_gather_lens: holdfast_hal::Kernel,
    pub(crate) c128a_decode: holdfast_hal::Kernel,
    pub(crate) c128a_prefill: holdfast_hal::Kernel,
    pub(crate) c4a_decode: holdfast_hal::Kernel,
    pub(crate) step_upload: holdfast_hal::Kernel,
}

impl AttnKernels {
    /// Compiles (or fetches from the device's module cache) [`source`] for `dev`.
    pub(crate) fn new(dev: &holdfast_hal::Device) -> Result<Self> {
        let m = dev.compile(source())?;
        Ok(AttnKernels {
            swa_decode: m.kernel("hf_dsv4_swa_decode")?,
            swa_prefill_gather_lens: m.kernel("hf_dsv4_swa_prefill_gather_lens")?,
            c128a_decode: m.kernel("hf_dsv4_c128a_decode")?,
            c128a_prefill: m.kernel("hf_dsv4_c128a_prefill")?,
            c4a_decode: m.kernel("hf_dsv4_c4a_decode")?,
            step_upload: m.kernel("hf_dsv4_step_upload")?,
        })
    }
}
