// The d = 256 key-major backward's consumers (bwd/sm90_256_kernel.cuh): warpgroups 1 and 2, 240
// registers.  Per tile, warpgroup g scores its decision tile (query rows 32g..32g+31: S^T_g, dP^T_g
// over all 64 keys), computes P^T_g and dS^T_g, stores them into the tile's shared P^T and dS^T,
// then both warpgroups add dV and dK by head dims (dims 128g..128g+127) over the retained halves;
// after the last tile dK and dV go to the outputs.
// Here: the tile's products (S^T and dP^T; dV and dK), the P^T / dS^T stores and the dK / dV
// stores.  In the kernel's body: the loop over the tiles with the rings' bookkeeping, the mask,
// test and vote (calls into bwd/common.cuh), and two steps that changed the SASS as functions here:
// S^T's and dP^T's zeros and fences (both instances) and P^T = exp2(S^T - lse), dS^T (the skipping
// instance).  The whole loop as a function (bwd256_consume) changed the skipping instance in every
// form tried (journal.md, issue 63).
//
// Fragments: entry 4n + 2hh + c of S^T_g, dP^T_g (m64n32: 64 keys x the warpgroup's 32 rows) is key
// krow + 8hh, query row qcol + 8n + 2tig + c of the tile; of dK, dV (m64n128), key krow + 8hh, dim
// 128 wg + 8n + 2tig + c.
#pragma once

#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_256_traits.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/wgmma.cuh"

namespace mala {
namespace cuda {

// S^T_g = K Q_g^T and dP^T_g = V dO_g^T over d (yq, yd: the warpgroup's rows of the Q and dO slots),
// one group, committed; s and dp zeroed and fenced by the caller (here, the zeros' fences changed
// the SASS of both instances).
template <typename T>
__device__ __forceinline__ void bwd256_keys_x_rows(float (&s)[16], float (&dp)[16], const uint32_t& sK,
                                                   const uint32_t& sV, const uint32_t& yq, const uint32_t& yd) {
  using C = BwdWs256;
  wgmma_ss_kmajor<C::BH, C::D, T>(s, sK, C::KTile::kBlockBytes, yq, C::QTile::kBlockBytes);
  wgmma_ss_kmajor<C::BH, C::D, T>(dp, sV, C::KTile::kBlockBytes, yd, C::QTile::kBlockBytes);
  wgmma_commit();
}

// The warpgroup's half of P^T and dS^T into the tile's shared P^T (sp_g) and dS^T (sds_g).
__device__ __forceinline__ void bwd256_store_p_ds(unsigned char* const& sp_g, unsigned char* const& sds_g,
                                                  const uint32_t (&pp)[8], const uint32_t (&dd)[8], const int& krow,
                                                  const int& qcol, const int& tig) {
  using STile = BwdWs256::STile;
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t off = STile::offset(krow + 8 * hh, qcol + 8 * n + 2 * tig);
      *reinterpret_cast<uint32_t*>(sp_g + off) = pp[2 * n + hh];
      *reinterpret_cast<uint32_t*>(sds_g + off) = dd[2 * n + hh];
    }
}

// dV += P^T dO, dK += dS^T Q over the query steps K0 .. K1 - 1 (k16 each) of the retained halves,
// the warpgroup's dims (bdo, bq: its dims of the dO and Q slots); issued, not committed.
template <typename T, int K0, int K1>
__device__ __forceinline__ void bwd256_dkdv(float (&dv)[64], float (&dk)[64], const uint32_t& sP, const uint32_t& sDS,
                                            const uint32_t& bdo, const uint32_t& bq) {
  using QTile = BwdWs256::QTile;
#pragma unroll
  for (int kq = K0; kq < K1; ++kq)
    WgmmaSS<128, 0, 1, T>::run(dv, wgmma_desc(sP + kq * 32, 16, 1024),
                               wgmma_desc(bdo + kq * 2048, QTile::kBlockBytes, 1024));
#pragma unroll
  for (int kq = K0; kq < K1; ++kq)
    WgmmaSS<128, 0, 1, T>::run(dk, wgmma_desc(sDS + kq * 32, 16, 1024),
                               wgmma_desc(bq + kq * 2048, QTile::kBlockBytes, 1024));
}

// After the last tile: dK (scaled) and dV of this thread's two key rows that the tile holds (< kn).
template <typename T>
__device__ __forceinline__ void bwd256_store_dkdv(const BwdParams& p, const BwdWork& w, const float (&dk)[64],
                                                  const float (&dv)[64], const int& krow, const int& kn, const int& wg,
                                                  const int& tig) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = krow + hh * 8;
    if (r >= kn) continue;
    bwd_store_dkdv_row<T, BwdWs256::D, 16>(p, w, r, 128 * wg + 2 * tig, [&](int n) {
      return make_float4(dk[4 * n + 2 * hh], dk[4 * n + 2 * hh + 1], dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1]);
    });
  }
}

}  // namespace cuda
}  // namespace mala
