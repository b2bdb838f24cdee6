// GPT pre-training from C++: pretrain_gpt.py's model, data, schedule and
// optimizer, with Megatron's flag names, and the same losses.
//
//   torchrun --no-python --nproc-per-node 4 build/py/examples/train_gpt \
//       --tensor-model-parallel-size 2 --data-path python/megatronapp/assets/kjv_excerpt.txt
//
// What it does per iteration, as megatronapp.training.train_step: the global
// batch of random windows keyed by (seed, iteration) from the byte-tokenized
// text (95% train), this data-parallel rank's microbatches, forward and
// backward of each (loss / microbatches), gradients averaged over dp x cp by
// mapp::DistributedDataParallel (buckets reduced during the last backward,
// --grad-compression with error feedback), sequence-parallel partial sums over
// tp, one global norm and clipping, AdamW (betas 0.9, 0.95; weight decay on
// matrices only; ZeRO-1 with --use-distributed-optimizer) at the warm-up +
// cosine learning rate. With --pipeline-model-parallel-size the model is split
// into stages (virtual stages with --virtual-pipeline-model-parallel-size) and
// each step runs the --pipeline-schedule through mapp::forward_backward, as
// pretrain_gpt.py does. --save / --save-interval / --load write and read
// pretrain_gpt.py's checkpoints (mapp/torch/checkpoint.h): either resumes
// the other's.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "mapp/codec/codec.h"
#include "mapp/common/check.h"
#include "mapp/torch/checkpoint.h"
#include "mapp/torch/checkpoint_engine.h"
#include "mapp/torch/ddp.h"
#include "mapp/torch/dist.h"
#include "mapp/torch/faults.h"
#include "mapp/torch/gpt.h"
#include "mapp/torch/ops.h"
#include "mapp/torch/pipeline.h"
#include "mapp/trace/tracer.h"

namespace {

struct Args {
  int tp = 1, pp = 1, cp = 1;
  int num_layers = 4, hidden_size = 256, num_attention_heads = 8, seq_length = 128;
  int vpp = 0, pipeline_memory_limit = -1, pipeline_replan_interval = 20;
  std::string pipeline_schedule = "1f1b", pipeline_dynamic_policy = "adaptive";
  int ffn_hidden_size = 0, micro_batch_size = 4, global_batch_size = 16;
  int train_iters = 100, lr_warmup_iters = 10, log_interval = 10, seed = 1234;
  int make_vocab_size_divisible_by = 128;
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.01, clip_grad = 1.0;
  double hidden_dropout = 0.0, attention_dropout = 0.0, init_method_std = 0.02;
  bool sequence_parallel = false, use_distributed_optimizer = false, no_overlap_grad_reduce = false;
  bool no_gradient_accumulation_fusion = false;
  std::string grad_compression = "none";
  int grad_compression_start_iter = 0;
  double bucket_size_mb = 25.0;
  std::string data_path, loss_csv, save, load;
  std::string distributed_backend = "gloo";
  bool trace = false;
  std::string trace_dir = "runs/trace";
  std::string recompute_granularity, recompute_method;
  int recompute_num_layers = 0;
  int save_interval = 0;
  bool async_save = false;
};

// Linear warm-up to lr, then cosine decay to min_lr (training/step.py: lr_at).
double lr_at(const Args& a, int it) {
  if (it < a.lr_warmup_iters) return a.lr * (it + 1) / a.lr_warmup_iters;
  const int span = std::max(1, a.train_iters - a.lr_warmup_iters);
  const double frac = std::min(1.0, static_cast<double>(it - a.lr_warmup_iters) / span);
  return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + std::cos(M_PI * frac));
}

// The text as UTF-8 bytes (the byte tokenizer, vocabulary 256): the training
// split, the first 95% (data.TextDataset).
at::Tensor train_tokens(const std::string& path, int seq_length) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw mapp::ValueError("data file '" + path + "' does not exist (--data-path)");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  at::Tensor bytes = at::empty({static_cast<std::int64_t>(text.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  const std::int64_t n = bytes.numel(), n_valid = static_cast<std::int64_t>(n * 0.05);
  at::Tensor train = bytes.slice(0, 0, n - n_valid).to(at::kLong);
  if (train.numel() <= seq_length + 1)
    throw mapp::ValueError("the training split of '" + path +
                           "' has fewer tokens than --seq-length + 1");
  return train;
}

// Global batch `it`: random windows keyed by (seed, iteration), [gbs, s + 1].
at::Tensor global_batch(const at::Tensor& stream, int it, const Args& a) {
  const std::int64_t mixed =
      (static_cast<std::int64_t>(a.seed) * 1000003 + it * 2) & 0x7FFFFFFFFFFF;
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(mixed));
  const at::Tensor starts =
      at::randint(0, stream.numel() - a.seq_length - 1, {a.global_batch_size}, g, at::kLong);
  return stream.index({starts.unsqueeze(1) + at::arange(a.seq_length + 1, at::kLong)});
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"GPT pre-training from C++ (megatronapp)"};
  app.add_option("--tensor-model-parallel-size", a.tp);
  app.add_option("--pipeline-model-parallel-size", a.pp);
  app.add_option("--context-parallel-size", a.cp);
  app.add_option("--virtual-pipeline-model-parallel-size", a.vpp,
                 "model chunks per pipeline stage (interleaved / dynamic schedules)");
  app.add_option("--pipeline-schedule", a.pipeline_schedule,
                 "gpipe, 1f1b, interleaved, zero-bubble, zb-v, dynamic");
  app.add_option("--pipeline-dynamic-policy", a.pipeline_dynamic_policy,
                 "planner policy of --pipeline-schedule dynamic: dfc, bfc, auto, adaptive");
  app.add_option("--pipeline-memory-limit", a.pipeline_memory_limit,
                 "dynamic schedule: live activations per stage (microbatch x chunk)");
  app.add_option("--pipeline-replan-interval", a.pipeline_replan_interval,
                 "dynamic adaptive: re-plan from measured times every N steps");
  app.add_option("--num-layers", a.num_layers);
  app.add_option("--hidden-size", a.hidden_size);
  app.add_option("--num-attention-heads", a.num_attention_heads);
  app.add_option("--seq-length", a.seq_length);
  app.add_option("--ffn-hidden-size", a.ffn_hidden_size);
  app.add_option("--micro-batch-size", a.micro_batch_size);
  app.add_option("--global-batch-size", a.global_batch_size);
  app.add_option("--train-iters", a.train_iters);
  app.add_option("--lr", a.lr);
  app.add_option("--min-lr", a.min_lr);
  app.add_option("--lr-warmup-iters", a.lr_warmup_iters);
  app.add_option("--weight-decay", a.weight_decay);
  app.add_option("--clip-grad", a.clip_grad);
  app.add_option("--seed", a.seed);
  app.add_option("--init-method-std", a.init_method_std);
  app.add_option("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by);
  app.add_option("--hidden-dropout", a.hidden_dropout);
  app.add_option("--attention-dropout", a.attention_dropout);
  app.add_flag("--sequence-parallel", a.sequence_parallel);
  app.add_option("--recompute-granularity", a.recompute_granularity,
                 "full: recompute the layers' activations in backward");
  app.add_option("--recompute-method", a.recompute_method, "uniform or block");
  app.add_option("--recompute-num-layers", a.recompute_num_layers,
                 "layers per recomputed group (uniform) / first N layers per stage (block)");
  app.add_flag("--use-distributed-optimizer", a.use_distributed_optimizer,
               "ZeRO-1: shard optimizer state over data-parallel ranks");
  app.add_option("--grad-compression", a.grad_compression,
                 "none, bf16, fp16, int8[:block], onebit[:block], topk:<ratio>, powersgd:<rank>");
  app.add_option("--grad-compression-start-iter", a.grad_compression_start_iter,
                 "run uncompressed for the first N iterations");
  app.add_option("--bucket-size-mb", a.bucket_size_mb, "gradient bucket size");
  app.add_flag("--no-overlap-grad-reduce", a.no_overlap_grad_reduce,
               "reduce gradients at the end of backward instead of during it");
  app.add_flag("--no-gradient-accumulation-fusion", a.no_gradient_accumulation_fusion,
               "compute each weight gradient into a temporary that autograd adds to the "
               "gradient buffer, instead of adding it in the GEMM itself");
  app.add_option("--data-path", a.data_path, "a UTF-8 text file (byte tokenizer)")->required();
  app.add_option("--log-interval", a.log_interval);
  app.add_flag("--trace", a.trace,
               "record a Chrome trace per rank (python -m megatronapp.trace aggregate)");
  app.add_option("--trace-dir", a.trace_dir, "per-rank trace files");
  app.add_option("--distributed-backend", a.distributed_backend,
                 "gloo (CPU) or nccl (one GPU per rank: cuda:LOCAL_RANK)")
      ->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--save", a.save, "checkpoint directory to save to");
  app.add_option("--save-interval", a.save_interval, "save every N iterations (and at the end)");
  app.add_flag("--async-save", a.async_save,
               "write and commit checkpoints on a background thread (training goes on once the "
               "state is copied to host memory)");
  app.add_option("--load", a.load,
                 "resume from this checkpoint directory (its latest) or iter_* path");
  app.add_option("--loss-csv", a.loss_csv,
                 "write iteration,loss,lr,grad_norm,seconds here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (a.cp != 1)
      throw mapp::ValueError(
          "train_gpt: context parallelism is not available from C++ yet; use "
          "examples/pretrain_gpt.py");
    // zb-v runs two chunks per stage in a V (set for you, as pretrain_gpt.py does)
    const int v = a.vpp > 0 ? a.vpp : (a.pipeline_schedule == "zb-v" && a.pp > 1 ? 2 : 1);
    if (a.vpp > 1 && a.pp == 1)
      throw mapp::ValueError(
          "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1");
    if (a.num_layers % (a.pp * v) != 0)
      throw mapp::ValueError("--num-layers " + std::to_string(a.num_layers) +
                             " does not divide evenly over " + std::to_string(a.pp * v) +
                             " virtual pipeline stages (" + std::to_string(a.pp) + " stages x " +
                             std::to_string(v) + " chunks)");
    if (a.hidden_dropout != 0.0 || a.attention_dropout != 0.0)
      throw mapp::ValueError("train_gpt: dropout is not available from C++ yet; pass 0");
    mapp::codec::Spec::parse(a.grad_compression);  // an unknown codec fails before any rendezvous
    // so do a schedule name, policy or chunk count that cannot run
    mapp::make_schedule(a.pipeline_schedule, a.pp, a.pp * v, v, a.pipeline_dynamic_policy,
                        a.pipeline_memory_limit);
    const auto st = mapp::dist::init_from_env(
        {.tp = a.tp, .pp = a.pp, .cp = a.cp, .backend = a.distributed_backend});
    // NCCL: the model, its gradients and the activations live on this rank's GPU.
    const at::Device device =
        a.distributed_backend == "nccl"
            ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(st.local_rank()))
            : at::Device(at::kCPU);
    const int dp = st.dp_size();
    if (a.global_batch_size % (a.micro_batch_size * dp))
      throw mapp::ValueError("global batch size " + std::to_string(a.global_batch_size) +
                             " is not divisible by micro-batch size (" +
                             std::to_string(a.micro_batch_size) + ") x data-parallel size (" +
                             std::to_string(dp) + ")");
    const int micro = a.global_batch_size / (a.micro_batch_size * dp);
    // The schedule (validated before any model is built); dynamic adaptive re-plans.
    std::unique_ptr<mapp::AdaptiveSchedule> adaptive;
    mapp::pipeline::Schedule schedule = mapp::make_schedule(
        a.pipeline_schedule, a.pp, micro, v, a.pipeline_dynamic_policy, a.pipeline_memory_limit);
    if (a.pp > 1 && a.pipeline_schedule == "dynamic" && a.pipeline_dynamic_policy == "adaptive")
      adaptive = std::make_unique<mapp::AdaptiveSchedule>(a.pp, micro, v, a.pipeline_memory_limit,
                                                          a.pipeline_replan_interval, st);
    torch::manual_seed(a.seed);
    const at::Tensor stream = train_tokens(a.data_path, a.seq_length);

    mapp::nn::GPTConfig cfg;
    const std::int64_t multiple = static_cast<std::int64_t>(a.make_vocab_size_divisible_by) * a.tp;
    cfg.vocab_size = (256 + multiple - 1) / multiple * multiple;
    cfg.hidden_size = a.hidden_size;
    cfg.num_layers = a.num_layers;
    cfg.num_attention_heads = a.num_attention_heads;
    cfg.seq_length = a.seq_length;
    cfg.ffn_hidden_size = a.ffn_hidden_size;
    cfg.init_method_std = a.init_method_std;
    cfg.sequence_parallel = a.sequence_parallel;
    cfg.recompute_granularity = a.recompute_granularity;
    cfg.recompute_method = a.recompute_method;
    cfg.recompute_num_layers = a.recompute_num_layers;
    // This rank's chunks: chunk c is virtual stage schedule.vstage(pp_rank, c)
    // (c * pp + pp_rank; zb-v's V: odd chunks backwards), with its share of
    // the layers (global numbers: the same weights at every pp).
    const int per = a.num_layers / (a.pp * v);
    std::vector<mapp::nn::GPTModel> chunks;
    std::vector<std::unique_ptr<mapp::DistributedDataParallel>> ddps;
    std::vector<mapp::DistributedDataParallel*> ddp_ptrs;
    std::vector<mapp::PipelineChunk> stages;
    for (int c = 0; c < v; ++c) {
      const int vs = schedule.vstage(st.pp_rank(), c);
      mapp::nn::GPTStage part{.pre_process = vs == 0, .post_process = vs == a.pp * v - 1};
      for (int i = 0; i < per; ++i) part.layer_numbers.push_back(vs * per + i);
      chunks.emplace_back(cfg, st, a.seed, part);
      chunks.back()->to(device);  // drawn on the CPU (the same weights everywhere), then moved
      ddps.push_back(std::make_unique<mapp::DistributedDataParallel>(
          chunks.back().ptr(), st,
          mapp::DDPOptions{.bucket_size_mb = a.bucket_size_mb,
                           .compression = a.grad_compression,
                           .compression_start_iter = a.grad_compression_start_iter,
                           .overlap_grad_reduce = !a.no_overlap_grad_reduce,
                           .gradient_accumulation_fusion = !a.no_gradient_accumulation_fusion}));
      ddp_ptrs.push_back(ddps.back().get());
      mapp::nn::GPTModel model = chunks.back();
      stages.push_back(
          {[model](const at::Tensor& x) mutable { return model->forward(x); }, ddps.back().get()});
    }
    const std::int64_t seq_between = a.sequence_parallel ? a.seq_length / a.tp : a.seq_length;
    const mapp::PipelineOptions pipe{
        .tensor_shape = {seq_between, a.micro_batch_size, a.hidden_size}, .device = device};

    // AdamW, weight decay on matrices only; ZeRO-1 shards it over dp.
    std::vector<mapp::ParamGroup> groups(2);
    for (const auto& model : chunks)
      for (const auto& p : model->parameters()) groups[p.dim() >= 2 ? 0 : 1].params.push_back(p);
    groups[0].options =
        torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(a.weight_decay);
    groups[1].options = torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(0.0);
    std::unique_ptr<mapp::DistributedOptimizer> zero;
    std::unique_ptr<torch::optim::AdamW> adamw;
    if (a.use_distributed_optimizer) {
      zero = std::make_unique<mapp::DistributedOptimizer>(ddp_ptrs, groups, st);
    } else {
      std::vector<torch::optim::OptimizerParamGroup> inner;
      for (const auto& g : groups)
        inner.emplace_back(g.params, std::make_unique<torch::optim::AdamWOptions>(g.options));
      adamw = std::make_unique<mapp::AdamW>(std::move(inner));
    }
    // Checkpoints: the model fields pretrain_gpt.py compares, and where the data stands.
    std::vector<mapp::CheckpointChunk> ckpt_chunks;
    for (int c = 0; c < v; ++c)
      ckpt_chunks.push_back({chunks[c].ptr(), chunks[c]->stage.layer_numbers, ddp_ptrs[c]});
    const std::string config_json =
        "{\"vocab_size\": " + std::to_string(cfg.vocab_size) +
        ", \"hidden_size\": " + std::to_string(cfg.hidden_size) +
        ", \"num_layers\": " + std::to_string(cfg.num_layers) +
        ", \"num_attention_heads\": " + std::to_string(cfg.num_attention_heads) +
        ", \"seq_length\": " + std::to_string(cfg.seq_length) + ", \"ffn_hidden_size\": " +
        std::to_string(cfg.ffn_hidden_size ? cfg.ffn_hidden_size : 4 * cfg.hidden_size) +
        ", \"share_embeddings_and_output_weights\": true, \"num_experts\": null, "
        "\"moe_ffn_hidden_size\": null, \"moe_layer_freq\": 1}";
    auto ckpt_options = [&](int iteration) {
      return mapp::CheckpointOptions{
          .adamw = adamw.get(),
          .distributed = zero.get(),
          .config_json = config_json,
          .extra_json = "{\"consumed_samples\": " +
                        std::to_string(static_cast<std::int64_t>(iteration) * a.global_batch_size) +
                        ", \"seed\": " + std::to_string(a.seed) + "}",
          .async_save = a.async_save};
    };
    int start = 0;
    if (!a.load.empty()) {
      const auto info = mapp::load_checkpoint(a.load, ckpt_chunks, st, ckpt_options(0));
      if (info) {
        start = static_cast<int>(info->iteration);
        if (st.rank() == 0)
          std::printf("[megatronapp] resumed from %s at iteration %d\n", info->path.c_str(), start);
      } else if (st.rank() == 0) {
        std::printf("[megatronapp] no checkpoint in %s; starting from scratch\n", a.load.c_str());
      }
    }
    if (a.trace) {  // the files megatronapp.trace reads: trace.rank<R>.json + its meta
      namespace fs = std::filesystem;
      fs::create_directories(a.trace_dir);
      const std::string base =
          (fs::path(a.trace_dir) / ("trace.rank" + std::to_string(st.rank()))).string();
      char host[256] = {0};
      ::gethostname(host, sizeof(host) - 1);
      std::ofstream(base + ".meta.json")
          << "{\"rank\": " << st.rank() << ", \"clock\": \"monotonic\", \"host\": \"" << host
          << "\", \"interval\": 1, \"iterations\": null, \"granularity\": \"full\", \"tp\": "
          << st.tp_rank() << ", \"pp\": " << st.pp_rank() << ", \"dp\": " << st.dp_rank()
          << ", \"tp_size\": " << st.tp_size() << ", \"pp_size\": " << st.pp_size()
          << ", \"dp_size\": " << dp << ", \"world\": " << st.world_size() << "}\n";
      mapp::trace::install(std::make_unique<mapp::trace::Tracer>(st.rank(), base + ".json"));
    }
    int saved_at = -1;
    std::ofstream csv;
    if (st.rank() == 0 && !a.loss_csv.empty()) {
      csv.open(a.loss_csv);
      csv << "iteration,loss,lr,grad_norm,seconds\n";
    }
    const std::string& g_tp = st.tensor_group();
    for (int it = start; it < a.train_iters; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      if (auto* tracer = mapp::trace::global()) tracer->set_iteration(it);
      mapp::faults::set_iteration(it);
      mapp::trace::Scope iteration_scope("iteration", mapp::trace::Category::kIteration);
      const double lr = lr_at(a, it);
      if (zero) {
        zero->set_lr(lr);
        zero->zero_grad();
      } else {
        for (auto& group : adamw->param_groups())
          static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
        for (auto* ddp : ddp_ptrs) ddp->zero_grad_buffer();
      }
      const at::Tensor window = global_batch(stream, it, a).to(device);
      auto rows = [&](int m) {
        const std::int64_t lo =
            (static_cast<std::int64_t>(m) * dp + st.dp_rank()) * a.micro_batch_size;
        return window.slice(0, lo, lo + a.micro_batch_size);
      };
      const mapp::PipelineResult res = mapp::forward_backward(
          adaptive ? adaptive->schedule() : schedule, stages,
          [&](int m) { return rows(m).slice(1, 0, a.seq_length); },
          [&](const at::Tensor& logits, int m) {  // [b, s, V/tp]: the mean token loss
            return mapp::nn::vocab_parallel_cross_entropy(logits.transpose(0, 1).to(at::kFloat),
                                                          rows(m).slice(1, 1).transpose(0, 1), g_tp)
                .mean();
          },
          st, pipe);
      if (adaptive) adaptive->observe(res);
      // The last stage's microbatch losses; tensor rank 0 counts them.
      at::Tensor total = at::zeros({1}, at::kDouble);
      if (!res.losses.empty() && st.tp_rank() == 0)
        total += at::stack(res.losses).to(at::kDouble).sum().cpu();
      // The data-parallel average (waits for the buckets), the
      // sequence-parallel sums, one global norm and clipping, the update.
      double norm;
      {
        mapp::trace::Scope optimizer_scope("optimizer", mapp::trace::Category::kOptimizer);
        if (zero) {
          norm = zero->clip_grad_norm(a.clip_grad);
          zero->step();
        } else {
          norm = mapp::finish_gradients(ddp_ptrs, st, a.clip_grad);
          adamw->step();
        }
      }
      const int dpc = dp * st.cp_size();
      mapp::torch_ext::all_reduce_sum_(total, st.world_group());
      const double mean = total.item<double>() / (micro * dpc);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (st.rank() == 0) {
        if (csv.is_open())
          csv << it + 1 << "," << std::setprecision(17) << mean << "," << lr << "," << norm << ","
              << secs << "\n";
        if ((it + 1) % a.log_interval == 0 || it == 0)
          std::printf(" iteration %6d/%6d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tokens/s\n",
                      it + 1, a.train_iters, mean, lr, norm,
                      a.global_batch_size * a.seq_length / secs);
      }
      if (!a.save.empty() && a.save_interval > 0 && (it + 1) % a.save_interval == 0) {
        mapp::save_checkpoint(a.save, it + 1, ckpt_chunks, st, ckpt_options(it + 1));
        saved_at = it + 1;
      }
    }
    if (!a.save.empty() && saved_at != a.train_iters && start < a.train_iters)
      mapp::save_checkpoint(a.save, a.train_iters, ckpt_chunks, st, ckpt_options(a.train_iters));
    mapp::wait_pending_save();  // an --async-save in flight is committed before exit
    std::fflush(stdout);
    mapp::trace::uninstall();  // flushes and closes the trace file
    mapp::dist::destroy(st);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
