// Internal: decode attention kernels (device code; launched by
// kernels/attention.cu).
//
// Launch: a persistent grid of num_sms * kCtasPerSm CTAs of 4 warps. Every
// CTA derives the same schedule from seq_lens / q_indptr: request b's
// attended key range [lo_b, L_b) is cut into splits_b chunks of at most C
// tokens, C chosen so that all chunks of all requests number at most
// max(0.8 ctas + 1, ctas - groups) + groups (one round of the grid when
// there are few (request, head, query tile) groups). A work item is
// (request, KV head, 16-row query tile, chunk) and runs on one CTA; CTA x
// takes items x, x + grid, ... Each warp of the CTA takes a contiguous
// quarter of the chunk's 16-token tiles, and the four (O, max, sum) are
// combined through shared memory at the end. A request with one chunk
// writes its output directly; otherwise each chunk writes an fp32 partial
// (unnormalized O, running max, sum) and MergeAttentionKernel (same grid,
// same schedule; on sm_90 launched early with programmatic dependent launch,
// waiting for the attention grid before it reads partials) combines them.
// The grid depends only on the options, so one captured graph serves every
// length. A soft cap selects a separate instantiation (kSoftCap).
//
// The kernel families (kernels/attention/; Create() picks one, see
// src/attention_params.h AttentionFamily):
//   tokens_in_m.cuh  keys' tokens in the MMA's M dimension, query rows in N
//                    (the default wherever it takes the shape: items of at
//                    most 8 query rows, group * q_len <= 8);
//   rows_in_m.cuh    query rows in M, tokens in N (more rows per item).
// Shared by both: schedule.cuh (the work schedule above), stage_layout.cuh
// (the shared-memory layout of K/V tiles), tile_copy.cuh (the per-warp
// cp.async ring of K/V tiles), q_stage.cuh (queries into f16), row_state.cuh
// (a row's (m, l, O), its merge and its end), merge.cuh (the CTA combine of
// an item and the split merge), ptx.cuh (PTX wrappers), launch.cuh (launch
// and Create()-time setup, instantiated per head dim by
// kernels/attention_d<D>.cu). The prefill families (prefill.cuh,
// prefill_sm90.cuh) share schedule.cuh, q_stage.cuh and row_state.cuh. A further family (e.g. one built for a newer
// architecture only) goes beside them as its own header, selected in
// launch.cuh's SelectAttentionKernel and AttentionFamily.
#ifndef FP4KV_KERNELS_ATTENTION_CUH_
#define FP4KV_KERNELS_ATTENTION_CUH_

#include "kernels/attention/merge.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/q_stage.cuh"
#include "kernels/attention/row_state.cuh"
#include "kernels/attention/rows_in_m.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/stage_layout.cuh"
#include "kernels/attention/tile_copy.cuh"
#include "kernels/attention/tokens_in_m.cuh"

#endif  // FP4KV_KERNELS_ATTENTION_CUH_
