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
// the operand traffic per flop of 128 × 128) wins. The SwiGLU epilogue stays short too (one exp per pair).
//
// ---- Note [SwiGLU pairs in the accumulator] ---------------------------------------------------------
//
// A warp group's wgmma accumulator gives each thread, per 8-column block of the tile, the two ADJACENT
// columns 2q and 2q + 1 (q = lane % 4) of rows r and r + 8. The epilogue hands a visitor node these values
// in register order (FragmentSize of them at a time, the first two of every four being one row's column
// pair). So with the gate's and the up projection's rows interleaved in B, each (gate, up) pair of one
// output element sits in one thread's consecutive registers: SwiGLUStore combines them with no shuffle and
// no shared memory, and writes h = silu(g) · u straight to global memory (one 16-bit store per pair, the
// four lanes of a quad writing 8 contiguous bytes). The node passes z through unchanged, so D = z is stored
// by the epilogue's ordinary TMA path (backward needs z). Each element's coordinates come from the
// epilogue's coordinate tensor (tCcD, relative to the thread's first element, whose absolute position is
// (M, N) - residue), the same tensor that masks the tile's edges.
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
};
/// The ping-pong schedule on 128 × 128 tiles (each consumer warp group owns a whole tile and the two alternate
/// between mainloop and epilogue), measured against Cooperative (docs/performance/gemm.md).
struct PingPong {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _2, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
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

/// The visitor node of Note [SwiGLU pairs in the accumulator]: passes z through and writes
/// H[m, n / 2] = silu(z[m, n]) · z[m, n + 1] for every even n of the thread's fragment.
template <class T>
struct SwiGLUStore {
  struct SharedStorage {};
  struct Arguments {
    T* ptr_h = nullptr;
    int64_t ldh = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return args.ptr_h != nullptr && get<1>(problem_shape) % 2 == 0;
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

  CUTLASS_HOST_DEVICE SwiGLUStore() {}
  CUTLASS_HOST_DEVICE SwiGLUStore(Params const& params, SharedStorage const&) : params(params) {}

  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor, class ThrResidue>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, ThrResidue residue, int64_t m0, int64_t n0, Params const& params)
        : tCcD(tCcD), residue(residue), m0(m0), n0(n0), params(params) {}

    CTensor tCcD;        // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): coordinates relative to the thread's first element
    ThrResidue residue;  // (M, N) minus the thread's first element's coordinates
    int64_t m0, n0;      // the thread's first element's absolute coordinates
    Params params;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v,
                                                            int epi_m, int epi_n,
                                                            cutlass::Array<ElementInput, FragmentSize> const& z) {
      static_assert(FragmentSize % 2 == 0, "SwiGLUStore: a fragment holds whole column pairs");
      Tensor crd = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        const auto c = crd(epi_v * FragmentSize + i);  // the gate's column is even, the up column next to it
        const auto c_up = crd(epi_v * FragmentSize + i + 1);
        // the pairing the note relies on (static coordinates: the compiler folds this check away when it holds)
        if (get<0>(c_up) != get<0>(c) || get<1>(c_up) != get<1>(c) + 1 || get<1>(c) % 2 != 0) __trap();
        if (elem_less(c, residue)) {
          const float g = static_cast<float>(z[i]), u = static_cast<float>(z[i + 1]);
          const float h = g / (1.0f + __expf(-g)) * u;
          const int64_t m = m0 + get<0>(c), n = n0 + get<1>(c);
          params.ptr_h[m * params.ldh + (n >> 1)] = T(h);
        }
      }
      return z;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    const auto M = get<0>(args.problem_shape_mnkl), N = get<1>(args.problem_shape_mnkl);
    const int64_t m0 = static_cast<int64_t>(M) - static_cast<int64_t>(get<0>(args.residue_tCcD));
    const int64_t n0 = static_cast<int64_t>(N) - static_cast<int64_t>(get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(args.tCcD, args.residue_tCcD, m0,
                                                                                     n0, params);
  }
};

/// H = swiglu(z) beside D = z (z = acc + bias, kept in fp32 until each is stored).
template <class T>
using SwiGLUTree = fusion::Sm90EVT<SwiGLUStore<T>, BiasAdd<T, float>>;

/// The GEMM with epilogue tree `Fusion` for 16-bit dtype T, in configuration `Config`.
template <class T, class Fusion, class Config = Cooperative>
struct Sm90Gemm {
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using Layout = cutlass::layout::RowMajor;     // A [M, K] and D [M, N]
  using LayoutB = cutlass::layout::ColumnMajor;  // B as CUTLASS's [K, N] column-major = our [N, K] row-major
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,  //
      void, Layout, kAlignment,                                       // no C
      T, Layout, kAlignment,                                          // D
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

template <class T>
typename SwiGLUTree<T>::Arguments swiglu_args(const Problem& p) {
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
