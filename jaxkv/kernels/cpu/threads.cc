// jaxkv_cpu_threads: how many threads XLA's intra-op pool gives the kernels (an int32 scalar);
// the loader's log line and the tests read it.
#include "parallel.h"

namespace {

xla::ffi::Error PoolThreads(xla::ffi::ThreadPool pool, xla::ffi::ResultBuffer<xla::ffi::S32> out) {
  out->typed_data()[0] = static_cast<int32_t>(pool.num_threads());
  return xla::ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCpuThreads, PoolThreads,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>().Ret<xla::ffi::Buffer<xla::ffi::S32>>());
