#include "mapp/codec/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <vector>

#include "mapp/common/check.h"

namespace mapp::codec {
namespace {

constexpr const char* kValidSpecs =
    "none, bf16, fp16, int8[:block], onebit[:block], topk:<ratio in (0,1]>, powersgd:<rank>";

std::int64_t num_blocks(std::int64_t n, std::int64_t b) { return (n + b - 1) / b; }

// Round to nearest, ties to even, for |v| < 2^22 (quantized values are within
// +-127): adding and subtracting 1.5 * 2^23 leaves the rounded integer. Unlike
// std::nearbyint this inlines and vectorizes.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.f;  // not folded: IEEE forbids (v + m) - m == v
  return (v + kMagic) - kMagic;
}

template <typename T>
T parse_number(const std::string& text, const std::string& spec) {
  std::istringstream is(text);
  T v{};
  is >> v;
  MAPP_CHECK(!is.fail() && is.eof(), "compression spec '", spec, "': '", text,
             "' is not a number; valid specs: ", kValidSpecs);
  return v;
}

void check_spec_kind(const Spec& spec, bool want_elementwise, const char* what) {
  MAPP_CHECK(spec.elementwise() == want_elementwise, what, " does not apply to codec ",
             spec.str());
}

}  // namespace

Spec Spec::parse(const std::string& text) {
  Spec s;
  const auto colon = text.find(':');
  const std::string name = text.substr(0, colon);
  const bool has_arg = colon != std::string::npos;
  const std::string arg = has_arg ? text.substr(colon + 1) : "";
  if (name == "none" || name == "bf16" || name == "fp16") {
    MAPP_CHECK(!has_arg, "compression spec '", text, "' takes no argument; valid specs: ",
               kValidSpecs);
    s.kind = name == "none" ? Kind::kNone : name == "bf16" ? Kind::kBF16 : Kind::kFP16;
  } else if (name == "int8" || name == "onebit") {
    s.kind = name == "int8" ? Kind::kInt8 : Kind::kOneBit;
    if (has_arg) s.block = parse_number<std::int64_t>(arg, text);
    MAPP_CHECK(s.block >= 8 && s.block % 8 == 0, "compression spec '", text,
               "': block must be a positive multiple of 8, got ", s.block);
  } else if (name == "topk") {
    s.kind = Kind::kTopK;
    MAPP_CHECK(has_arg, "compression spec 'topk' needs a ratio, e.g. topk:0.01");
    s.ratio = parse_number<double>(arg, text);
    MAPP_CHECK(s.ratio > 0.0 && s.ratio <= 1.0, "compression spec '", text,
               "': the top-k ratio must lie in (0, 1]");
  } else if (name == "powersgd") {
    s.kind = Kind::kPowerSGD;
    MAPP_CHECK(has_arg, "compression spec 'powersgd' needs a rank, e.g. powersgd:4");
    s.rank = parse_number<std::int64_t>(arg, text);
    MAPP_CHECK(s.rank >= 1, "compression spec '", text, "': rank must be >= 1");
  } else {
    MAPP_CHECK(false, "unknown compression spec '", text, "'; valid specs: ", kValidSpecs);
  }
  return s;
}

std::string Spec::str() const {
  switch (kind) {
    case Kind::kNone: return "none";
    case Kind::kBF16: return "bf16";
    case Kind::kFP16: return "fp16";
    case Kind::kInt8: return "int8:" + std::to_string(block);
    case Kind::kOneBit: return "onebit:" + std::to_string(block);
    case Kind::kTopK: {
      std::ostringstream os;
      os << "topk:" << ratio;
      return os.str();
    }
    case Kind::kPowerSGD: return "powersgd:" + std::to_string(rank);
  }
  return "?";
}

bool Spec::biased() const {
  return kind == Kind::kInt8 || kind == Kind::kOneBit || kind == Kind::kTopK ||
         kind == Kind::kPowerSGD;
}

bool Spec::elementwise() const {
  return kind == Kind::kNone || kind == Kind::kBF16 || kind == Kind::kFP16 ||
         kind == Kind::kInt8 || kind == Kind::kOneBit;
}

std::int64_t Spec::alignment() const {
  return (kind == Kind::kInt8 || kind == Kind::kOneBit) ? block : 1;
}

std::size_t encoded_bytes(const Spec& spec, std::int64_t n) {
  MAPP_CHECK(n >= 0, "negative element count ", n);
  switch (spec.kind) {
    case Kind::kNone: return 4 * n;
    case Kind::kBF16:
    case Kind::kFP16: return 2 * n;
    case Kind::kInt8: return 4 * num_blocks(n, spec.block) + n;
    case Kind::kOneBit: return 4 * num_blocks(n, spec.block) + (n + 7) / 8;
    case Kind::kTopK: return 8 * topk_count(spec, n);
    case Kind::kPowerSGD: break;
  }
  MAPP_CHECK(false, "codec ", spec.str(), " has no fixed payload size");
}

std::int64_t topk_count(const Spec& spec, std::int64_t n) {
  if (n <= 0) return 0;
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(spec.ratio * n)), 1, n);
}

// ---- IEEE half conversions ---------------------------------------------------

std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return static_cast<std::uint16_t>(u >> 16);
}

float bf16_to_float(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint16_t float_to_fp16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000;
  const std::uint32_t abs = x & 0x7fffffff;
  if (abs > 0x7f800000) return static_cast<std::uint16_t>(sign | 0x7e00);  // NaN
  if (abs >= 0x477ff000) return static_cast<std::uint16_t>(sign | 0x7c00);  // overflow -> inf
  if (abs < 0x38800000) {  // subnormal half (or zero): scale by 2^24, round
    float a;
    std::memcpy(&a, &abs, 4);
    const float scaled = a * 16777216.0f;  // exact: a < 2^-14
    const std::uint32_t r = static_cast<std::uint32_t>(std::nearbyint(scaled));
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t m = abs + 0xc8000fff + ((abs >> 13) & 1);  // rebias exponent, round even
  return static_cast<std::uint16_t>(sign | (m >> 13));
}

float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1f;
  const std::uint32_t man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= sign;
    std::memcpy(&f, &u, 4);
    return f;
  }
  std::uint32_t u = exp == 31 ? (sign | 0x7f800000 | (man << 13))
                              : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- element-wise codecs -------------------------------------------------------

namespace {

// Quantizes x (+ err when given) block by block; with err, leaves the new
// residual (x + err) - decode(out) in err. One pass over each block for the
// scale, one to quantize.
void encode_int8(const float* x, float* err, std::int64_t n, std::int64_t b, std::uint8_t* out) {
  float* scales = reinterpret_cast<float*>(out);
  auto* q = reinterpret_cast<std::int8_t*>(out + 4 * num_blocks(n, b));
  for (std::int64_t blk = 0; blk * b < n; ++blk) {
    const std::int64_t lo = blk * b, hi = std::min(n, lo + b);
    float amax = 0.f;
    if (err) {
      for (std::int64_t i = lo; i < hi; ++i) {
        err[i] += x[i];
        amax = std::max(amax, std::fabs(err[i]));
      }
    } else {
      for (std::int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i]));
    }
    const float scale = amax / 127.f;
    scales[blk] = scale;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    const float* v = err ? err : x;
    for (std::int64_t i = lo; i < hi; ++i) {
      const float r = std::clamp(round_even(v[i] * inv), -127.f, 127.f);
      q[i] = static_cast<std::int8_t>(r);
      if (err) err[i] -= r * scale;
    }
  }
}

template <bool kAdd>
void decode_int8(const std::uint8_t* in, std::int64_t n, std::int64_t b, float* out) {
  const float* scales = reinterpret_cast<const float*>(in);
  const auto* q = reinterpret_cast<const std::int8_t*>(in + 4 * num_blocks(n, b));
  for (std::int64_t lo = 0; lo < n; lo += b) {
    const float s = scales[lo / b];
    const std::int64_t hi = std::min(n, lo + b);
    for (std::int64_t i = lo; i < hi; ++i) {
      const float v = static_cast<float>(q[i]) * s;
      if constexpr (kAdd) out[i] += v;
      else out[i] = v;
    }
  }
}

void encode_onebit(const float* x, float* err, std::int64_t n, std::int64_t b,
                   std::uint8_t* out) {
  float* scales = reinterpret_cast<float*>(out);
  std::uint8_t* bits = out + 4 * num_blocks(n, b);
  std::memset(bits, 0, (n + 7) / 8);
  for (std::int64_t blk = 0; blk * b < n; ++blk) {
    const std::int64_t lo = blk * b, hi = std::min(n, lo + b);
    double sum = 0.0;
    if (err) {
      for (std::int64_t i = lo; i < hi; ++i) {
        err[i] += x[i];
        sum += std::fabs(err[i]);
      }
    } else {
      for (std::int64_t i = lo; i < hi; ++i) sum += std::fabs(x[i]);
    }
    const float scale = static_cast<float>(sum / static_cast<double>(hi - lo));
    scales[blk] = scale;
    const float* v = err ? err : x;
    for (std::int64_t i = lo; i < hi; ++i) {
      const bool pos = v[i] >= 0.f;
      if (pos) bits[i / 8] |= static_cast<std::uint8_t>(1u << (i % 8));
      if (err) err[i] -= pos ? scale : -scale;
    }
  }
}

template <bool kAdd>
void decode_onebit(const std::uint8_t* in, std::int64_t n, std::int64_t b, float* out) {
  const float* scales = reinterpret_cast<const float*>(in);
  const std::uint8_t* bits = in + 4 * num_blocks(n, b);
  for (std::int64_t lo = 0; lo < n; lo += b) {  // b is a multiple of 8
    const float s = scales[lo / b];
    const std::int64_t hi = std::min(n, lo + b);
    for (std::int64_t i = lo; i < hi; ++i) {
      const float sign = static_cast<float>(((bits[i >> 3] >> (i & 7)) & 1) * 2) - 1.f;
      if constexpr (kAdd) out[i] += sign * s;
      else out[i] = sign * s;
    }
  }
}

template <bool kAdd>
void decode_impl(const Spec& spec, const std::uint8_t* in, std::int64_t n, float* out) {
  check_spec_kind(spec, true, "decode");
  switch (spec.kind) {
    case Kind::kNone: {
      const float* v = reinterpret_cast<const float*>(in);
      for (std::int64_t i = 0; i < n; ++i) {
        if constexpr (kAdd) out[i] += v[i];
        else out[i] = v[i];
      }
      return;
    }
    case Kind::kBF16:
    case Kind::kFP16: {
      const auto* h = reinterpret_cast<const std::uint16_t*>(in);
      const bool bf = spec.kind == Kind::kBF16;
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = bf ? bf16_to_float(h[i]) : fp16_to_float(h[i]);
        if constexpr (kAdd) out[i] += v;
        else out[i] = v;
      }
      return;
    }
    case Kind::kInt8: decode_int8<kAdd>(in, n, spec.block, out); return;
    case Kind::kOneBit: decode_onebit<kAdd>(in, n, spec.block, out); return;
    default: return;
  }
}

}  // namespace

namespace {

void encode_cast(bool bf, const float* x, float* err, std::int64_t n, std::uint16_t* h) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = err ? x[i] + err[i] : x[i];
    h[i] = bf ? float_to_bf16(v) : float_to_fp16(v);
    if (err) err[i] = v - (bf ? bf16_to_float(h[i]) : fp16_to_float(h[i]));
  }
}

void encode_any(const Spec& spec, const float* x, float* err, std::int64_t n, std::uint8_t* out) {
  check_spec_kind(spec, true, "encode");
  switch (spec.kind) {
    case Kind::kNone: {
      auto* o = reinterpret_cast<float*>(out);
      for (std::int64_t i = 0; i < n; ++i) o[i] = err ? x[i] + err[i] : x[i];
      if (err) std::memset(err, 0, 4 * n);
      return;
    }
    case Kind::kBF16:
    case Kind::kFP16:
      encode_cast(spec.kind == Kind::kBF16, x, err, n, reinterpret_cast<std::uint16_t*>(out));
      return;
    case Kind::kInt8: encode_int8(x, err, n, spec.block, out); return;
    case Kind::kOneBit: encode_onebit(x, err, n, spec.block, out); return;
    default: return;
  }
}

}  // namespace

void encode(const Spec& spec, const float* x, std::int64_t n, std::uint8_t* out) {
  encode_any(spec, x, nullptr, n, out);
}

void decode(const Spec& spec, const std::uint8_t* in, std::int64_t n, float* out) {
  decode_impl<false>(spec, in, n, out);
}

void decode_add(const Spec& spec, const std::uint8_t* in, std::int64_t n, float* acc) {
  decode_impl<true>(spec, in, n, acc);
}

void encode_with_feedback(const Spec& spec, const float* x, float* err, std::int64_t n,
                          std::uint8_t* out) {
  encode_any(spec, x, err, n, out);
}

// ---- top-k ------------------------------------------------------------------------

void topk_encode(const float* x, std::int64_t n, std::int64_t k, std::uint8_t* out) {
  MAPP_CHECK(k >= 0 && k <= n, "topk: k=", k, " out of [0, ", n, "]");
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  MAPP_CHECK(n <= INT32_MAX, "topk: ", n, " elements exceed 32-bit indices");
  std::iota(order.begin(), order.end(), 0);
  auto larger = [x](std::int32_t a, std::int32_t b) {
    const float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa > fb || (fa == fb && a < b);
  };
  std::nth_element(order.begin(), order.begin() + k, order.end(), larger);
  std::sort(order.begin(), order.begin() + k);
  auto* idx = reinterpret_cast<std::int32_t*>(out);
  auto* val = reinterpret_cast<float*>(out + 4 * k);
  for (std::int64_t i = 0; i < k; ++i) {
    idx[i] = order[i];
    val[i] = x[order[i]];
  }
}

void topk_decode_add(const std::uint8_t* in, std::int64_t k, std::int64_t n, float* acc) {
  const auto* idx = reinterpret_cast<const std::int32_t*>(in);
  const auto* val = reinterpret_cast<const float*>(in + 4 * k);
  for (std::int64_t i = 0; i < k; ++i) {
    MAPP_CHECK(idx[i] >= 0 && idx[i] < n, "topk payload index ", idx[i], " outside [0, ", n,
               ")");
    acc[idx[i]] += val[i];
  }
}

// ---- PowerSGD helper -------------------------------------------------------------

void gram_schmidt(float* m, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t c = 0; c < cols; ++c) {
    for (std::int64_t p = 0; p < c; ++p) {
      double dot = 0.0;
      for (std::int64_t r = 0; r < rows; ++r) dot += double(m[r * cols + c]) * m[r * cols + p];
      for (std::int64_t r = 0; r < rows; ++r) m[r * cols + c] -= static_cast<float>(dot) * m[r * cols + p];
    }
    double norm = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) norm += double(m[r * cols + c]) * m[r * cols + c];
    norm = std::sqrt(norm);
    const float inv = norm > 1e-30 ? static_cast<float>(1.0 / norm) : 0.f;
    for (std::int64_t r = 0; r < rows; ++r) m[r * cols + c] *= inv;
  }
}

}  // namespace mapp::codec
