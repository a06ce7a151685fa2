// The sm90 GEMM kernels of core/gemm_sm90.h, as CUTLASS 3.x types: included by one kernel file per
// instantiation (core/gemm_sm90_<kernel>.cu), each compiled for sm_90a only and without ATen.
//
// ---- The kernel ---------------------------------------------------------------------------------------
//
// A TN GEMM (A [M, K] and B [N, K] both K-major, as linear's activations and weight are; D [M, N] row-major)
// from CUTLASS's sm90 collective builders:
//   mainloop  TMA loads into a multi-stage shared-memory ring (as many stages as fit beside the epilogue's
//             buffers), warp-specialized: one producer warp group issues the TMA loads, two consumer warp
//             groups run wgmma on one 128 × 256 × 64 tile between them (the cooperative schedule) and share
//             its epilogue; a cluster of 2 CTAs along M multicasts each B tile to both.
//   scheduler persistent: one CTA per SM walks the output tiles, so the next tile's loads overlap the
//             previous tile's epilogue.
//   epilogue  an epilogue visitor tree (EVT) over the fp32 accumulators: + bias[n] (a row broadcast; a null
//             pointer broadcasts 0), then D through shared memory and a TMA store.
// Why cooperative and not ping-pong: ping-pong overlaps one warp group's epilogue with the other's mainloop,
// which pays off when the epilogue is long relative to the K loop; the Llama projections have K = 2048 or
// 8192 (32 to 128 k-tiles per output tile), where the mainloop dominates and the larger 128 × 256 tile (half
// the operand traffic per flop of 128 × 128) wins. The SwiGLU kernels are the exception: they run the ping-pong
// schedule and store h by TMA (Note [SwiGLU through shared memory]), the form that measured ahead of two passes,
// and swiglu_linear picks between them and two passes by measurement (core/gemm_cuda.cu, kSwiGLUTable).
//
// ---- Note [SwiGLU pairs in the accumulator] ---------------------------------------------------------
//
// A warp group's wgmma accumulator gives each thread, per 8-column block of the tile, the two ADJACENT
// columns 2q and 2q + 1 (q = lane % 4) of rows r and r + 8. The epilogue hands a visitor node these values
// in register order (FragmentSize of them at a time, the first two of every four being one row's column
// pair). So with the gate's and the up projection's rows interleaved in B, each (gate, up) pair of one
// output element sits in one thread's consecutive registers: SwiGLUTmaStore combines them with no shuffle,
// h = silu(g) · u, and passes z through unchanged, so D = z is stored by the epilogue's ordinary TMA path
// (backward needs z). Each element's coordinates come from the epilogue's coordinate tensor (tCcD, relative to
// the thread's first element), the same tensor that masks the tile's edges.
//
// ---- Note [SwiGLU through shared memory] ------------------------------------------------------------
//
// The ping-pong SwiGLU kernels (SwiGLUTmaStore) store h the way the epilogue stores D: each epilogue subtile
// (64 × 32 of z) has its h subtile (64 × 16) in a shared-memory buffer of the epilogue's store stages (swizzled as
// the builder swizzles D's), written by the threads and stored by one TMA store per subtile, issued beside D's and
// committed in the same bulk group, so the epilogue's store pipeline (which waits for a stage's stores before its
// buffers are written again) guards both buffers. visit() computes each thread's h values into registers (the
// pairing of Note [SwiGLU pairs in the accumulator]); postreduce() writes them to the stage's buffer (it runs after
// the epilogue has acquired that stage, also when the TMA store of the previous subtile is delayed); tma_store() runs
// after the epilogue's fence and barrier. A thread's element lies in its CTA tile at its first element's position
// (residue_cD - residue_tCcD) plus its tCcD coordinate; less the subtile's origin, and with the column halved, that
// is the element's place in the h buffer. TMA clips the stores at the matrix's edges. Built without D (ElementD void),
// the same epilogue stores h alone: z never leaves the registers.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <cute/tensor.hpp>

#include <atomic>

#include "core/gemm_sm90.h"

namespace opforge {
namespace gemm {
namespace sm90 {
namespace detail {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

/// The chosen configuration (the file's header says why).
struct Cooperative {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
};
/// The ping-pong schedule on 128 × 128 tiles (each consumer warp group owns a whole tile and the two alternate
/// between mainloop and epilogue), measured against Cooperative (docs/performance/gemm.md).
struct PingPong {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _2, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
};
using TileShape = Cooperative::TileShape;
constexpr int kAlignment = 8;  // elements of a 16-bit dtype in 16 bytes: TMA's granule

/// bias[n] broadcast over the rows (null: 0), in fp32.
template <class T, class Tile = TileShape>
using BiasRow = fusion::Sm90RowBroadcast<0, Tile, T, float, Stride<_0, _1, int64_t>, kAlignment>;

/// z = acc + bias, rounded to T where it is stored.
template <class T, class Out, class Tile = TileShape>
using BiasAdd = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, Out, float, cutlass::FloatRoundStyle::round_to_nearest>,
                                fusion::Sm90AccFetch, BiasRow<T, Tile>>;

/// The visitor node of Note [SwiGLU through shared memory]: passes z through and stores
/// H[m, n / 2] = silu(z[m, n]) · z[m, n + 1] (every even n) through a shared-memory buffer and a TMA store, in step
/// with the epilogue's own store of D. `Tile` is the CTA tile, `EpiTile` the epilogue subtile (M × N of z; H's
/// subtile is half as wide), `Stages` the epilogue's store stages (its StagesD: the kernel file checks it).
template <class T, class Tile, class EpiTile, int Stages>
struct SwiGLUTmaStore {
  using ElementAux = T;  // the element an epilogue without D takes for its own buffers' types
  using StrideH = Stride<int64_t, _1, int64_t>;
  static constexpr int kEpiM = size<0>(EpiTile{});
  static constexpr int kEpiN = size<1>(EpiTile{});
  static_assert(kEpiN % 16 == 0, "SwiGLUTmaStore: H's subtile rows must be whole 16-byte TMA granules");
  using EpiTileH = Shape<Int<kEpiM>, Int<kEpiN / 2>>;
  using SmemLayoutAtom = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                                  StrideH, T, EpiTileH>());
  using SmemLayoutTma = decltype(tile_to_shape(SmemLayoutAtom{}, EpiTileH{}, Step<_1, _2>{}));
  using SmemLayout = decltype(tile_to_shape(SmemLayoutTma{}, make_shape(Int<kEpiM>{}, Int<kEpiN / 2>{}, Int<Stages>{}),
                                            Step<_1, _2, _3>{}));

  struct SharedStorage {
    alignas(cutlass::detail::alignment_for_swizzle(SmemLayout{})) array_aligned<T, size(SmemLayout{})> smem_h;
  };
  struct Arguments {
    T* ptr_h = nullptr;
    int64_t ldh = 0;
  };
  struct Params {
    using TmaH = decltype(make_tma_copy(SM90_TMA_STORE{},
                                       make_tensor(static_cast<T*>(nullptr), repeat_like(StrideH{}, int32_t(0)), StrideH{}),
                                       SmemLayoutTma{}));
    TmaH tma_store_h;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Tensor h = make_tensor(args.ptr_h, make_layout(make_shape(int32_t(M), int32_t(N / 2), int32_t(L)),
                                                   StrideH{args.ldh, _1{}, int64_t(0)}));
    return {make_tma_copy(SM90_TMA_STORE{}, h, SmemLayoutTma{})};
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    // TMA: a 16-byte aligned base and row stride; N even (whole pairs)
    return args.ptr_h != nullptr && get<1>(problem_shape) % 2 == 0 &&
           reinterpret_cast<uintptr_t>(args.ptr_h) % 16 == 0 && (args.ldh * sizeof(T)) % 16 == 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE SwiGLUTmaStore() {}
  CUTLASS_HOST_DEVICE SwiGLUTmaStore(Params const& params, SharedStorage const& shared)
      : params_ptr(&params), smem_h(const_cast<T*>(shared.smem_h.data())) {}

  Params const* params_ptr = nullptr;
  T* smem_h = nullptr;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor, class RTensor, class STensor, class STensorS2G, class GTensorS2G>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, int m0, int n0, RTensor rH, STensor sH, STensorS2G bSG_sH,
                                          GTensorS2G bSG_gH, Params const* params_ptr)
        : tCcD(tCcD), m0(m0), n0(n0), rH(rH), sH(sH), bSG_sH(bSG_sH), bSG_gH(bSG_gH), params_ptr(params_ptr) {}

    CTensor tCcD;       // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): coordinates relative to the thread's first element
    int m0, n0;         // the thread's first element's coordinates in the CTA tile
    RTensor rH;         // (PAIRS): the subtile's h values of this thread, in register order
    STensor sH;         // (EPI_TILE_M, EPI_TILE_N / 2, PIPE): the shared-memory buffer
    STensorS2G bSG_sH;  // (TMA, TMA_M, TMA_N, PIPE)
    GTensorS2G bSG_gH;  // (TMA, TMA_M, TMA_N, EPI_M, EPI_N)
    Params const* params_ptr;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&,
                                                                    int epi_v, int epi_m, int epi_n,
                                                                    cutlass::Array<ElementInput, FragmentSize> const& z) {
      static_assert(FragmentSize % 2 == 0, "SwiGLUTmaStore: a fragment holds whole column pairs");
      Tensor crd = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        const auto c = crd(epi_v * FragmentSize + i);
        const auto c_up = crd(epi_v * FragmentSize + i + 1);
        // the pairing Note [SwiGLU pairs in the accumulator] relies on (static: folded away when it holds)
        if (get<0>(c_up) != get<0>(c) || get<1>(c_up) != get<1>(c) + 1 || get<1>(c) % 2 != 0) __trap();
        const float g = static_cast<float>(z[i]), u = static_cast<float>(z[i + 1]);
        rH((epi_v * FragmentSize + i) / 2) = T(g / (1.0f + __expf(-g)) * u);
      }
      return z;
    }

    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration, bool issue_smem_store) {
      if (!issue_smem_store) return;
      const int stage = store_iteration % Stages;
      Tensor crd = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size(rH); ++k) {
        const auto c = crd(2 * k);
        const int r = m0 + get<0>(c) - epi_m * kEpiM;
        const int col = (n0 + get<1>(c) - epi_n * kEpiN) >> 1;  // the pair's gate column is even
        sH(r, col, stage) = rH(k);
      }
    }

    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if (issue_tma_store) {
        copy(params_ptr->tma_store_h, bSG_sH(_, _, _, store_iteration % Stages), bSG_gH(_, _, _, epi_m, epi_n));
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    Tensor mH = params_ptr->tma_store_h.get_tma_tensor(make_shape(M, N / 2, L));                  // (M, N / 2, L)
    Tensor gH = local_tile(mH, make_shape(size<0>(Tile{}), size<1>(Tile{}) / _2{}), make_coord(m, n, l));
    Tensor gH_epi = flat_divide(gH, EpiTileH{});                       // (EPI_TILE_M, EPI_TILE_N / 2, EPI_M, EPI_N)
    Tensor sH = cute::as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_h), SmemLayout{}));
    ThrCopy thrblk_s2g = params_ptr->tma_store_h.get_slice(_0{});
    Tensor bSG_sH = thrblk_s2g.partition_S(sH);
    Tensor bSG_gH = thrblk_s2g.partition_D(gH_epi);
    Tensor rH = make_tensor<T>(make_layout(size(take<0, 3>(shape(args.tCcD))) / _2{}));
    // the thread's first element in the CTA tile: (M, N) - residue_tCcD, less the tile's origin (M, N) - residue_cD
    const int m0 = static_cast<int>(get<0>(args.residue_cD) - get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(get<1>(args.residue_cD) - get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(rH), decltype(sH), decltype(bSG_sH), decltype(bSG_gH)>(
        args.tCcD, m0, n0, rH, sH, bSG_sH, bSG_gH, params_ptr);
  }
};

/// The ping-pong SwiGLU kernels' epilogue subtile (the builder's choice for this schedule, fixed here because the
/// H buffer's shape depends on it) and stages (the builder's StagesD for 128 × 128 tiles: min(8 subtiles, 2)).
using SwiGLUPingPongEpiTile = Shape<_64, _32>;
constexpr int kSwiGLUPingPongStages = 2;

/// PingPong with the epilogue subtile the SwiGLU tree is built for.
struct PingPongSwiGLU : PingPong {
  using EpilogueTile = SwiGLUPingPongEpiTile;
};

/// H = swiglu(z) through shared memory and TMA, beside D = z (TMA as well) or alone (the kernel built with no D).
template <class T, class Tile>
using SwiGLUTmaTree =
    fusion::Sm90EVT<SwiGLUTmaStore<T, Tile, SwiGLUPingPongEpiTile, kSwiGLUPingPongStages>, BiasAdd<T, float, Tile>>;

/// The GEMM with epilogue tree `Fusion` for 16-bit dtype T, in configuration `Config`; ElementD void builds it without D
/// (the tree's own stores are its only output).
template <class T, class Fusion, class Config = Cooperative, class ElementD = T>
struct Sm90Gemm {
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using Layout = cutlass::layout::RowMajor;     // A [M, K] and D [M, N]
  using LayoutB = cutlass::layout::ColumnMajor;  // B as CUTLASS's [K, N] column-major = our [N, K] row-major
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      typename Config::EpilogueTile, float, float,  //
      void, Layout, kAlignment,                     // no C
      ElementD, Layout, kAlignment,                 // D
      typename Config::EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,  //
      T, Layout, kAlignment,                                //
      T, LayoutB, kAlignment,                               //
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Device::Arguments;
};

/// The fusion arguments of each tree.
template <class T, class Tile = TileShape>
typename BiasAdd<T, T, Tile>::Arguments bias_args(const Problem& p) {
  return {{}, {static_cast<const T*>(p.bias), T(0), {}}, {}};
}

template <class T, class Tile>
typename SwiGLUTmaTree<T, Tile>::Arguments swiglu_tma_args(const Problem& p) {
  return {{{}, {static_cast<const T*>(p.bias), T(0), {}}, {}}, {static_cast<T*>(p.H), p.ldh}};
}

template <class G, class FusionArgs>
typename G::Arguments arguments(const Problem& p, const FusionArgs& fusion_args) {
  using T = typename G::Kernel::ElementA;
  using StrideA = typename G::Kernel::StrideA;
  using StrideB = typename G::Kernel::StrideB;
  using StrideD = typename G::Kernel::StrideD;
  StrideA sa{};
  get<0>(sa) = p.lda;
  StrideB sb{};
  get<0>(sb) = p.ldb;
  StrideD sd{};
  get<0>(sd) = p.ldd;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  typename G::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {p.M, p.N, p.K, 1},
                             {static_cast<const T*>(p.A), sa, static_cast<const T*>(p.B), sb},
                             {fusion_args, nullptr, sd, static_cast<T*>(p.D), sd},
                             hw};
  return args;
}

template <class G, class FusionArgs>
size_t workspace(const Problem& p, const FusionArgs& fusion_args) {
  return G::Device::get_workspace_size(arguments<G>(p, fusion_args));
}

/// Raises the kernel's dynamic shared memory limit on `device` once (GemmUniversalAdapter::initialize would do it on
/// every call; once keeps the call path free of it, also while a CUDA graph captures).
template <class G>
bool shared_memory_ready(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> state[kMaxDevices] = {};  // 0 not yet, 1 done, 2 failed
  if (device < 0 || device >= kMaxDevices) return false;
  int s = state[device].load(std::memory_order_acquire);
  if (s == 0) {
    constexpr int smem = static_cast<int>(G::Kernel::SharedStorageSize);
    cudaError_t err = cudaSuccess;
    if (smem >= (48 << 10)) {
      err = cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    if (err != cudaSuccess) (void)cudaGetLastError();  // clear it: the caller reports the failure
    s = err == cudaSuccess ? 1 : 2;
    state[device].store(s, std::memory_order_release);
  }
  return s == 1;
}

template <class G, class FusionArgs>
Status launch(const Problem& p, const FusionArgs& fusion_args, void* ws, cudaStream_t stream) {
  const typename G::Arguments args = arguments<G>(p, fusion_args);
  if (G::Device::can_implement(args) != cutlass::Status::kSuccess) return Status::kCannotImplement;
  if (!shared_memory_ready<G>(p.device)) return Status::kError;
  if (G::Kernel::initialize_workspace(args, ws, stream, nullptr) != cutlass::Status::kSuccess) return Status::kError;
  typename G::Kernel::Params params = G::Kernel::to_underlying_arguments(args, ws);
  return G::Device::run(params, stream) == cutlass::Status::kSuccess ? Status::kOk : Status::kError;
}

}  // namespace detail
}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
