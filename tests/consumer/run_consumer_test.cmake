# Installs BUILD_DIR into WORK_DIR/prefix, builds SOURCE_DIR against it, runs it.
# EXE is the program to run; TORCH_CMAKE_DIR (optional) is torch's share/cmake.
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test step failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
set(torch_args)
if(TORCH_CMAKE_DIR)
  set(torch_args -DTorch_DIR=${TORCH_CMAKE_DIR}/Torch -DTORCH_CUDA_ARCH_LIST=9.0)
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release ${torch_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/${EXE})
