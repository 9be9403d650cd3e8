#!/usr/bin/env bash
# The commands behind the numbers in docs/results.md and docs/reproductions.md (run from the repository root).
set -x
cd "$(dirname "$0")/.."
G=.venv/bin/gradsift
D=../shared/data/tinyshakespeare.txt
O=runs/docs
ALL="dense topk randomk randomk:shared=true regtopk rtopk gs rsb gsb sidco sidco:dist=gp sidco:dist=gamma dgc redsync gaussiank"
# 1. selection (issue 14): exact top-k and SIDCo on the kernels, against torch.topk, DGC and one read pass, on
# Gaussian, Laplace and Student-t vectors and on real whole-model gradients of charlm and wordlm
$G train --task charlm --data $D --compressor dense --workers 4 --steps 30 --dump-grads $O/charlm-grads.pt --out $O/dump --overwrite --quiet
$G train --task wordlm --data $D --compressor dense --workers 2 --steps 8 --dump-grads $O/wordlm-grads.pt --out $O/dump-wordlm --overwrite --quiet
SEL="topk sidco sidco:dist=gp sidco:dist=gamma dgc"
for dist in gaussian laplace student-t $O/charlm-grads.pt $O/wordlm-grads.pt; do
  $G bench select --compressors $SEL --sizes 26214400 --ratios 0.1 0.01 0.001 --dist $dist --calls 5 --threads 2 \
     --out $O/select-$(basename $dist .pt) --overwrite --quiet
done
# 2. the wire against PyTorch's hooks on shaped links, time to target, faults (issues 7 and 13; root, about 40 min)
$G cluster bench --out $O/cluster --overwrite --data $D --quiet
# 2b. 1 Gbit/s, every method timed on the same steps, repeated (issue 13; docs/results.md section 4, about 40 min)
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/process_draw.py --starts 6 --data $D
ALLM=(DDP topk "topk 0.1%" sidco dgc gsb regtopk rtopk)
$G cluster bench --out $O/cluster-4x1gbit-charlm-all --overwrite --sweep-rates 1gbit --tasks charlm --host-counts 4 --repeats 3 --steps 60 --methods "${ALLM[@]}" --no-faults --no-target --data $D --quiet
$G cluster bench --out $O/cluster-4x1gbit-charlm-60 --overwrite --sweep-rates 1gbit --tasks charlm --host-counts 4 --repeats 5 --steps 60 --methods DDP gsb regtopk --no-faults --no-target --data $D --quiet
$G cluster bench --out $O/cluster-2x1gbit-charlm-all --overwrite --sweep-rates 1gbit --tasks charlm --host-counts 2 --repeats 3 --steps 60 --methods "${ALLM[@]}" --no-faults --no-target --data $D --quiet
$G cluster bench --out $O/cluster-2x1gbit-charlm-5 --overwrite --sweep-rates 1gbit --tasks charlm --host-counts 2 --repeats 5 --steps 60 --methods "${ALLM[@]}" --no-faults --no-target --data $D --quiet
$G cluster bench --out $O/cluster-4x1gbit-wordlm-all --overwrite --sweep-rates 1gbit --tasks wordlm --host-counts 4 --repeats 3 --steps 40 --methods "${ALLM[@]}" --no-faults --no-target --data $D --quiet
# 3. comparisons (issues 3 and 4)
$G compare --task mnist1d-cnn --workers 8 --ratio 0.01 --compressors dense topk randomk rtopk regtopk gs rsb gsb --out $O/issue3-0.01 --quiet
$G compare --task mnist1d-cnn --workers 8 --ratio 0.001 --compressors dense topk randomk rtopk regtopk gs rsb gsb --out $O/issue3-0.001 --quiet
$G compare --task mnist1d-cnn --workers 8 --ratio 0.01 --bandwidth-gbps 1 --compressors dense topk sidco sidco:dist=gp sidco:dist=gamma dgc redsync gaussiank --out $O/issue4-mnist1d --quiet
$G compare --task charlm --data $D --workers 4 --ratio 0.01 --steps 120 --bandwidth-gbps 1 --compressors dense topk sidco sidco:dist=gp sidco:dist=gamma dgc redsync gaussiank --out $O/issue4-charlm --quiet
# 4. reproductions (issue 6): docs/reproductions.md is this report, full size, run alone (about an hour on
# 2 cores; anything else running beside it slows it 2-4x). `--scale 0.5` halves every training budget; a rerun
# of some experiments into the same DIR keeps the other sections, and `--reuse` takes its finished runs.
$G reproduce all --out $O/reproduce --quiet
# the rtopk, gsb and lags sections were then rewritten from the same runs (--reuse; lags re-measures its gloo step
# times) after their verdict texts were made to follow the numbers:
$G reproduce rtopk gsb lags --out $O/reproduce --reuse --quiet
# stop 39: the rtopk (two regimes), gsb (eq. 13's two readings, error feedback), sidco (the estimate alone) and
# regtopk-toy/-linreg (scale tables) sections rerun on the current code, one thread each, and spliced into
# docs/reproductions.md (regtopk-cnn and lags are the full run's above):
$G reproduce rtopk --out $O/reproduce-39 --quiet
OMP_NUM_THREADS=1 $G reproduce gsb --out $O/reproduce-39-gsb --quiet
OMP_NUM_THREADS=1 $G reproduce sidco --out $O/reproduce-39-sidco --quiet
OMP_NUM_THREADS=1 $G reproduce regtopk-toy regtopk-linreg --out $O/reproduce-39-regtopk --quiet
for r in reproduce-39 reproduce-39-gsb reproduce-39-sidco reproduce-39-regtopk; do
  .venv/bin/python benchmarks/make_results.py --splice $O/$r
done
# stop 40: sidco (with its charlm time to target), lags (the per-layer table) and regtopk-cnn rerun and spliced;
# docs/results.md sections 1 (the two compares of part 3 above, rerun) and 3 (this lags run) spliced in place:
OMP_NUM_THREADS=1 $G reproduce sidco --out $O/reproduce-40-sidco --quiet
$G reproduce lags --out $O/reproduce-40-lags --quiet
OMP_NUM_THREADS=1 $G reproduce regtopk-cnn --out $O/reproduce-40-regtopk-cnn --quiet
for r in reproduce-40-sidco reproduce-40-lags reproduce-40-regtopk-cnn; do
  .venv/bin/python benchmarks/make_results.py --splice $O/$r
done
.venv/bin/python benchmarks/make_results.py --splice-results $O/reproduce-40-lags/lags "Measured at stop 40 ..."
# stop 51: SIDCo's three forms (Algorithm 1 as printed, the estimate alone, corrected) on 3 seeds with the race under
# the training recipe; REGTOP-k's printed Delta over mu; rTop-k's LSTM half in its regime (new section); LAGS rerun.
# One after another, alone (about 25 + 8 + 50 + 6 min); each spliced in (a new experiment's section is inserted):
OMP_NUM_THREADS=1 $G reproduce sidco --out $O/reproduce-46-sidco --quiet
OMP_NUM_THREADS=1 $G reproduce regtopk-linreg --out $O/reproduce-46-linreg --quiet
$G reproduce rtopk-lstm --out $O/reproduce-46-rtopk-lstm --quiet
$G reproduce lags --out $O/reproduce-46-lags --quiet
for r in reproduce-46-sidco reproduce-46-linreg reproduce-46-rtopk-lstm reproduce-46-lags; do
  .venv/bin/python benchmarks/make_results.py --splice $O/$r
done
# how often a 2-rank gloo script exits 0 with and without gradsift.ddp.finish() (docs/ddp-reference.md)
.venv/bin/python benchmarks/exit_rate.py --runs 20
# CI-sized, used for docs only when $O/reproduce is missing:
$G reproduce all --quick --out $O/reproduce-quick --quiet
# 6. the scatter route (docs/results.md section 6): bytes a rank receives, the projection, accuracy at
# 16 workers (about 50 min), and the step on shaped links at 100 and 25 Mbit/s (root, run alone, about 70 min)
.venv/bin/python benchmarks/scatter_bytes.py --data $D
.venv/bin/python benchmarks/scatter_projection.py
.venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-acc --keeps 1 4
$G cluster bench --out $O/cluster-100mbit-scatter --overwrite --sweep-rates 100mbit --tasks wordlm --host-counts 2 4 8 --repeats 1 --steps 54 --methods "PowerSGD r2" topk "topk gather" --no-faults --no-target --data $D --quiet
$G cluster bench --out $O/cluster-25mbit-scatter --overwrite --sweep-rates 25mbit --tasks wordlm --host-counts 4 8 --repeats 1 --steps 54 --methods "PowerSGD r2" topk "topk gather" --no-faults --no-target --data $D --quiet
# 7. sharded models (docs/results.md section 7; root, run alone, about 20 min)
$G cluster bench --out $O/cluster-fsdp --overwrite --sweep-rates 100mbit --tasks wordlm --host-counts 4 --repeats 1 --steps 44 --methods FSDP "FSDP topk" --no-faults --no-target --data $D --quiet
$G cluster bench --out $O/cluster-hsdp --overwrite --sweep-rates 100mbit --tasks wordlm --host-counts 2 --repeats 1 --steps 44 --methods HSDP "HSDP topk" --no-faults --no-target --data $D --quiet
# 8. selection over a whole model's layers (docs/results.md section 8; run alone, about 3 min)
for m in resnet50 bert-base gpt2-small; do
  $G bench select --compressors topk sidco dgc gsb regtopk rtopk randomk gaussiank redsync --model $m --ratios 0.01 --calls 10 --threads 1 --out $O/model-$m --overwrite --quiet
done
# 10. time to dense's quality (docs/results.md section 10; about 40 + 10 + 70 min on 2 cores, the cluster race
# as root and alone, about 25 min); then the section is assembled from the reports
$G race --task mnist1d-cnn --workers 8 --ratio 0.01 --links 0.1 10 --methods dense bf16 powersgd:rank=1 powersgd:rank=2 powersgd:rank=4 local:period=8 local:period=4 local:period=8,outer=nesterov local:period=8,compressor=topk local:period=32,compressor=topk topk sidco dgc regtopk rtopk gaussiank redsync --out $O/race-mnist1d-0.01
$G race --task mnist1d-cnn --workers 8 --ratio 0.001 --factor 2 --links 0.1 10 --methods dense topk sidco dgc regtopk rtopk gaussiank redsync --out $O/race-mnist1d-0.001
OMP_NUM_THREADS=1 $G race --task gptlm --data $D --workers 8 --ratio 0.01 --factor 2 --links 0.1 10 --methods dense bf16 powersgd:rank=2 local:period=8 topk sidco --out $O/race-gptlm-0.01
$G cluster race --hosts 4 --rate 100mbit --tasks charlm --steps 300 --factor 2 --data $D --out $O/cluster-race-charlm-4x100mbit
.venv/bin/python benchmarks/race_section.py benchmarks/race_section.txt $O/race-mnist1d-0.01/race.md $O/race-mnist1d-0.001/race.md $O/race-gptlm-0.01/race.md $O/cluster-race-charlm-4x100mbit/race.md
# 11. DGC's and GaussianK's defaults against the forms as printed (docs/results.md section 11; about 20 min)
$G race --task mnist1d-cnn --workers 8 --ratio 0.01 --links 0.1 10 --methods dense gaussiank:refine=paper gaussiank dgc:memory=momentum dgc --out $O/race-11-0.01
$G race --task mnist1d-cnn --workers 8 --ratio 0.001 --factor 2 --links 0.1 10 --methods dense gaussiank dgc --out $O/race-11-0.001
# 12. the Adam recipe on gptlm (docs/results.md section 12; three races side by side on 2 cores, about 50 min; the
# dense runs of the first are copied into the other two before they start, which --reuse then reads)
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adam_recipe_table.py
OMP_NUM_THREADS=1 $G race --task gptlm --data $D --workers 8 --ratio 0.01 --factor 1.5 --links 0.1 10 --sparse-collective gather --methods dense topk --out $O/race-gptlm-adam-a
OMP_NUM_THREADS=1 $G race --task gptlm --data $D --workers 8 --ratio 0.01 --factor 1.5 --links 0.1 10 --sparse-collective gather --methods dense sidco bf16 --reuse --out $O/race-gptlm-adam-b
OMP_NUM_THREADS=1 $G race --task gptlm --data $D --workers 8 --ratio 0.01 --factor 1.5 --links 0.1 10 --sparse-collective gather --methods dense powersgd:rank=2 local:period=8 --reuse --out $O/race-gptlm-adam-c
# (the three folders' runs copied into one, then the table of all of them, re-priced without training)
OMP_NUM_THREADS=1 $G race --task gptlm --data $D --workers 8 --ratio 0.01 --factor 1.5 --links 0.1 10 --sparse-collective gather --methods dense bf16 powersgd:rank=2 local:period=8 topk sidco --reuse --out $O/race-gptlm-adam
# 13. bytes on the wire (docs/results.md section 13; a minute, then the two 4-step wordlm runs and the race, 10 min)
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/wire_bytes.py --data $D
for r in 0.01 0.001; do $G train --task wordlm --data $D --compressor topk --ratio $r --workers 8 --steps 4 --out $O/wire-wordlm-$r; done
OMP_NUM_THREADS=1 $G race --task mnist1d-cnn --workers 8 --ratio 0.001 --factor 2 --links 0.1 10 --methods dense gaussiank topk topk:value_dtype=fp32 gaussiank:value_dtype=fp32 --out $O/race-13-coded
OMP_NUM_THREADS=1 $G race --task mnist1d-cnn --workers 8 --ratio 0.01 --factor 1.5 --links 0.1 10 --methods dense topk sidco dgc regtopk rtopk gaussiank redsync --out $O/race-13-all-0.01
OMP_NUM_THREADS=1 $G race --task mnist1d-cnn --workers 8 --ratio 0.001 --factor 2 --links 0.1 10 --methods dense topk sidco dgc regtopk rtopk gaussiank redsync --out $O/race-13-all-0.001
# 14. an 8-bit residual under FSDP (docs/results.md section 14; FSDP's exchange in the simulator, 4 ranks, 3 seeds;
# two such loops side by side on the 2 cores, about 15 min)
for task in charlm gptlm; do for seed in 0 1 2; do for r in fp32 fp8; do
  OMP_NUM_THREADS=1 $G train --task $task --data $D --fsdp --workers 4 --compressor topk:residual_dtype=$r --seed $seed --quiet --out $O/fp8-residual/$task/$r/seed$seed --overwrite
done; done; done
# 15. the scatter route by keep on three tasks (docs/results.md section 15; one thread a run, about 75 min on both
# cores with two or three of these side by side), how much the workers' entries overlap (4 min), then 8 shaped hosts
# (root, alone, 13 min)
for n in 4 8; do
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-acc-$n-rerun --workers $n --keeps 1.75 4 --tasks mnist1d-cnn
done
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-lm-4 --workers 4 --keeps 1.75 4 --tasks charlm gptlm
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-lm-8c --workers 8 --keeps 1.75 4 --tasks charlm
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-lm-8g --workers 8 --keeps 1.75 4 8 --tasks gptlm
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-lm-16g --workers 16 --keeps 4 --tasks gptlm --seeds 0
# its seeds 1 and 2 (two runs side by side, about 20 min), then the three merged (--reuse trains nothing):
for s in 1 2; do
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-lm-16g-s$s --workers 16 --keeps 4 --tasks gptlm --seeds $s &
done; wait
mkdir -p $O/scatter-lm-16g3 && cp -r $O/scatter-lm-16g/gptlm-* $O/scatter-lm-16g-s1/gptlm-* $O/scatter-lm-16g-s2/gptlm-* $O/scatter-lm-16g3/
.venv/bin/python benchmarks/scatter_accuracy.py --data $D --out $O/scatter-lm-16g3 --workers 16 --keeps 4 --tasks gptlm --seeds 0 1 2 --reuse
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/union_share.py --data $D --workers 8
$G cluster bench --out $O/cluster-coded-8-scatter --overwrite --sweep-rates 25mbit 100mbit --tasks wordlm --host-counts 8 --repeats 1 --steps 54 --methods "PowerSGD r2" "topk scatter" --no-faults --no-target --data $D --quiet
# the LAGS reproduction again, alone (8 min), spliced into docs/reproductions.md
$G reproduce lags --out $O/reproduce-47-lags --quiet
.venv/bin/python benchmarks/make_results.py --splice $O/reproduce-47-lags
# REGTOP-k's CNN at the paper's scale (whole model at 0.1%, 10.8M parameters, 3 seeds; about 80 min alone), and its
# toy and linear-regression sections again (one thread, 13 min alone); both spliced into docs/reproductions.md
$G reproduce regtopk-cnn --out $O/reproduce-48-regtopk-cnn --quiet
OMP_NUM_THREADS=1 $G reproduce regtopk-toy regtopk-linreg --out $O/reproduce-48-regtopk-linreg --quiet
for r in reproduce-48-regtopk-cnn reproduce-48-regtopk-linreg; do
  .venv/bin/python benchmarks/make_results.py --splice $O/$r
done
# the stale SIDCo, GSB and rTop-k reproductions rerun on the coded wire (one thread each, two side by side: sidco with
# gsb, then rtopk with the rest of gsb), each spliced into docs/reproductions.md:
OMP_NUM_THREADS=1 $G reproduce sidco --out $O/reproduce-56-sidco --quiet &
OMP_NUM_THREADS=1 $G reproduce gsb --out $O/reproduce-56-gsb --quiet &
wait -n
OMP_NUM_THREADS=1 $G reproduce rtopk --out $O/reproduce-56-rtopk --quiet
wait
# (gsb's section then rewritten from the same runs once its verdict said "diverged" instead of nan:)
$G reproduce gsb --out $O/reproduce-56-gsb --reuse --quiet
$G reproduce rtopk --out $O/reproduce-56-rtopk --reuse --quiet  # (its verdict's last sentence, likewise)
for r in reproduce-56-sidco reproduce-56-gsb reproduce-56-rtopk; do
  .venv/bin/python benchmarks/make_results.py --splice $O/$r
done
echo BATCH DONE

# 16. the hook's own cost on loopback (docs/results.md "The hook's own cost where the network is free"; a few minutes,
# run alone)
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hook_cost.py --model mlp --methods ddp fp16 powersgd topk sidco dgc regtopk randomk --steps 20
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hook_cost.py --model transformer --methods ddp fp16 powersgd topk sidco --steps 15 --warm 5

# 21. every method's hook on loopback (docs/results.md "The hook's own cost, every method"; about 8 min, run alone;
# the plots go to docs/img/hook-bench-MODEL.png)
for m in mlp transformer resnet50; do
  .venv/bin/gradsift bench hook --model $m --out $O/hook-$m --overwrite && cp $O/hook-$m/hook.png docs/img/hook-bench-$m.png
done

# 18. the measured race on a transformer with AdamW (docs/results.md "Measured race on a transformer"; root, about
# 10 min, run alone; the plot is the README's picture)
$G cluster race --hosts 4 --rate 100mbit --tasks gptlm --steps 300 --factor 2 --methods DDP "bf16 hook" "PowerSGD r2" "local SGD H=8" "topk 1%" --data $D --out $O/cluster-race-gptlm-psgd && cp $O/cluster-race-gptlm-psgd/race.png docs/img/cluster-race-gptlm.png
# 19. sparse local SGD measured on charlm (docs/results.md section 19, "Measured: charlm"; root, about 14 min, alone)
$G cluster race --hosts 4 --rate 100mbit --tasks charlm --steps 300 --factor 2 --methods DDP "local SGD H=8" "sparse local SGD H=8" "sparse local SGD H=8 10%" "topk 1%" --data $D --out $O/cluster-race-local-charlm && cp $O/cluster-race-local-charlm/race.png docs/img/cluster-race-local-charlm.png
# values below 16 bits (docs/results.md section 20): bytes an entry, and quality on gptlm against bf16's seed spread
for vd in int2 int4; do OMP_NUM_THREADS=1 .venv/bin/python benchmarks/wire_bytes.py --data $D --value-dtype $vd --ratios 0.01 0.001 --no-timing; done
OMP_NUM_THREADS=1 $G race --task gptlm --data $D --workers 8 --ratio 0.01 --factor 1.5 --links 0.1 --sparse-collective gather --methods dense topk topk:value_dtype=int2 local:period=8,compressor=topk,value_dtype=int2 --seeds 3 --out $O/race-gptlm-int2 --quiet
